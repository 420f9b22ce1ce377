"""One process of the 2-process RL loop test (run by tests/test_rl_loop.py).

Usage: multiprocess_rl_worker.py PORT PROCESS_ID NUM_PROCESSES TOKENIZER_DIR OUT_DIR
Expects JAX_NUM_CPU_DEVICES=4. Writes OUT_DIR/result_<id>.json.
"""

import json
import pathlib
import sys
import traceback


def main():
    port, process_id, num_processes, tokenizer_dir, out_dir = sys.argv[1:6]
    process_id, num_processes = int(process_id), int(num_processes)
    result = {"ok": False, "process_id": process_id}
    try:
        from areal_jax.parallel import initialize_distributed

        assert initialize_distributed(f"127.0.0.1:{port}", num_processes, process_id)
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        from areal_jax.models.tokenizer import Tokenizer
        from areal_jax.parallel import MeshConfig
        from areal_jax.trainer.config import RLConfig
        from tests.test_rl_loop import make_loop

        tokenizer = Tokenizer.from_pretrained(tokenizer_dir)
        rl = RLConfig(steps=3, batch_size=4, max_staleness=1, max_concurrent=4, max_group_age=1)
        loop = make_loop(tokenizer, rl=rl, mesh=MeshConfig(num_generation_devices_per_host=2), devices=None,
                         row_offset=1000 * process_id)
        assert loop.cluster.meshes.train.devices.size == 4 and loop.cluster.meshes.generation.devices.size == 2
        engine = loop.cluster.engine
        out = loop.run()
        gathered = [np.asarray(multihost_utils.process_allgather(x, tiled=True))
                    for x in jax.tree.leaves(out.final_params)]
        served = [np.asarray(x) for x in jax.tree.leaves(engine.params)]
        result.update(
            versions=[m["version"] for m in out.history],
            engine_version=engine.version,
            staleness_max=max(m["staleness/max"] for m in out.history),
            params_checksum=float(sum(float(np.abs(g).sum()) for g in gathered)),
            served_equals_trained=all(np.array_equal(a, b) for a, b in zip(served, gathered)),
            balanced=out.rollout_report.balanced,
        )
        result["ok"] = True
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr, flush=True)
    pathlib.Path(out_dir, f"result_{process_id}.json").write_text(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
