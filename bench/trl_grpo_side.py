"""TRL half of bench/trl_side_by_side.py: GRPOTrainer (torch, CPU) on the shared workload; runs under .venv-ref.

Reads a JSON request on stdin, prints one JSON line with one record per optimizer step:
when the step ended and when its completions were scored (perf_counter: generation ends
just before scoring, training after it), its completion tokens and its mean reward.

Request: {model_dir, reward_file, rows: [{messages, answer, prompt_ids}], steps, batch, n, max_new_tokens,
          lr, b1, b2, eps, weight_decay, max_grad_norm, seed, threads, out_dir}
Rows are consumed in order, `batch` per step (no shuffling), so step k sees the same prompts
as the areal_jax side's step k.
"""

import importlib.util
import json
import sys
import time

import datasets
import torch
import transformers
import trl


def _load_reward(path):
    """areal_jax's arithmetic reward, loaded by file path (importing the package would pull in JAX)."""
    spec = importlib.util.spec_from_file_location("arithmetic_task_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.arithmetic_reward


class StepClock(transformers.TrainerCallback):
    """Timestamps the end of each optimizer step."""

    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def run(model_dir, reward_file, rows, steps, batch, n, max_new_tokens, lr, b1, b2, eps, weight_decay,
        max_grad_norm, seed, threads, out_dir):
    torch.set_num_threads(threads)
    # Not AutoTokenizer: for a "qwen2" config.json it builds Qwen2Tokenizer, which replaces the
    # task tokenizer's per-character pre-tokenizer with Qwen's byte-level one (spaces get lost).
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
    # The chat template must give the prompt ids the areal_jax side trains on.
    for row in rows[:batch]:
        ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        if list(ids) != row["prompt_ids"]:
            raise SystemExit(f"prompt ids differ between the two tokenizers: {list(ids)} vs {row['prompt_ids']}")
    reward = _load_reward(reward_file)
    per_step = []  # completion tokens and mean reward of each scored batch (one per step here)

    def arithmetic(completions, answer, completion_ids, **_):
        scores = [reward(c[0]["content"], a) for c, a in zip(completions, answer)]
        per_step.append({"tokens": sum(len(ids) for ids in completion_ids), "reward": sum(scores) / len(scores),
                         "scored": time.perf_counter()})
        return scores

    data = datasets.Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows[:steps * batch]])
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = trl.GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, seed=seed, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=steps, shuffle_dataset=False,
        # One generation batch of batch x n completions, one optimizer step on all of it.
        per_device_train_batch_size=batch * n, num_generations=n, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, max_completion_length=max_new_tokens, temperature=1.0,
        top_p=1.0, top_k=0, beta=0.0, scale_rewards="group",
        learning_rate=lr, adam_beta1=b1, adam_beta2=b2, adam_epsilon=eps, weight_decay=weight_decay,
        max_grad_norm=max_grad_norm, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch")
    clock = StepClock()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=arithmetic, args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    if len(clock.ends) != steps or len(per_step) != steps:
        raise RuntimeError(f"expected {steps} steps, saw {len(clock.ends)} step ends and {len(per_step)} scorings")
    return {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "steps": [{"end": e, **s} for e, s in zip(clock.ends, per_step)]}


if __name__ == "__main__":
    print(json.dumps(run(**json.loads(sys.stdin.read()))))
