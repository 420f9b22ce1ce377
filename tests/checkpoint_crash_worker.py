"""Saves checkpoints back to back until killed; tests/test_checkpoint.py SIGKILLs it mid-save.

Usage: python -m tests.checkpoint_crash_worker DIRECTORY PROGRESS_FILE NUM_ELEMENTS

Step s holds `state_for(s, n)` (content fixed by s alone), meta {"step": s}, and a grain
iterator over range(...) that has yielded s elements, so its next element must be s.
After every `save` call returns, "started <s>" is appended to PROGRESS_FILE.
"""

from __future__ import annotations

import os
import sys


def state_for(step: int, n: int) -> dict:
    """The state saved at `step`: fp32 [n], bf16 [n/4], int32 [n/8], each a function of step."""
    import jax.numpy as jnp

    return {
        "w": jnp.arange(n, dtype=jnp.float32) * step,
        "nested": {
            "b": ((jnp.arange(n // 4) % 97) * step).astype(jnp.bfloat16),
            "i": jnp.arange(n // 8, dtype=jnp.int32) * step,
        },
    }


def data_iterator():
    """The iterator whose position is checkpointed beside the state."""
    import grain

    return iter(grain.MapDataset.range(1 << 30).to_iter_dataset())


def main(directory: str, progress_file: str, n: int) -> None:
    from areal_jax.checkpoint import CheckpointConfig, Checkpointer

    ckpt = Checkpointer(CheckpointConfig(directory, max_to_keep=2, async_save=True))
    it = data_iterator()
    step = 0
    with open(progress_file, "a") as progress:
        while True:
            step += 1
            next(it)
            ckpt.save(step, state=state_for(step, n), meta={"step": step}, data_iterator=it, force=True)
            progress.write(f"started {step}\n")
            progress.flush()


if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_NUM_CPU_DEVICES"] = "1"
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
