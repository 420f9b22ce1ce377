"""One process of the 2-process agent RL test (run by tests/test_agent_workflow.py): the RL loop
with the AgentWorkflow over HTTP, each process serving its own endpoint to its own sessions.

Usage: multiprocess_agent_worker.py PORT PROCESS_ID NUM_PROCESSES TOKENIZER_DIR OUT_DIR
Expects JAX_NUM_CPU_DEVICES=4. Writes OUT_DIR/result_<id>.json.
"""


async def agent(client, row) -> float:
    """Two calls of one conversation (the second continues the first: one row); reward: parity."""
    messages = list(row.messages)
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [first.choices[0].message, {"role": "user", "content": "Go on."}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return float(len(second.choices[0].message.content or "") % 2)


def run(process_id: int, args: list[str]) -> dict:
    import numpy as np

    from areal_jax.generation import EngineConfig
    from areal_jax.jobs.rl_loop_builder import build_rl_loop
    from areal_jax.models import ModelConfig, init_params
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.parallel import MeshConfig
    from areal_jax.ppo import AdvantageConfig
    from areal_jax.rollout.workflow import RLVRConfig
    from areal_jax.trainer import OptimizerConfig, PPOConfig, RLConfig, TrainEngineConfig
    from areal_jax.workflows.agent import AgentConfig, AgentWorkflow
    from tests.test_rl_loop import rows

    tokenizer = Tokenizer.from_pretrained(args[0])
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    workflow = AgentWorkflow(RLVRConfig(n_samples=2, max_new_tokens=4, filter_all_equal_rewards=False), tokenizer,
                             AgentConfig(agent="tests.multiprocess_agent_worker:agent", transport="http"))
    loop = build_rl_loop(
        cfg, init_params(cfg, 0, std=0.3), tokenizer=tokenizer, data_iter=rows(tokenizer, offset=1000 * process_id),
        rl=RLConfig(steps=2, batch_size=4, max_staleness=1, max_concurrent=4),
        ppo=PPOConfig(num_minibatches=1), train_engine=TrainEngineConfig(max_tokens_per_microbatch=256), optimizer=OptimizerConfig(lr=1e-3),
        advantages=AdvantageConfig(norm="group"), workflow=workflow,
        engine=EngineConfig(num_slots=8, max_seq_len=128, decode_chunk=2),
        mesh=MeshConfig(num_generation_devices_per_host=2), devices=None)
    out = loop.run()
    return {"versions": [m["version"] for m in out.history], "engine_version": loop.cluster.engine.version,
            "sessions": [m["agent/sessions"] for m in out.history],
            "calls_mean": [m["agent/calls_mean"] for m in out.history],
            "failed": [m["agent/failed_sessions"] for m in out.history],
            "endpoint_stopped": workflow.endpoint is None, "served": workflow.service is not None,
            "loss": [float(np.asarray(m["train/loss"])) for m in out.history]}


if __name__ == "__main__":
    from tests.multiprocess import worker_main

    worker_main(run)
