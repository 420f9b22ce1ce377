"""Helpers shared by the bench scripts: the torch side, machine ceilings, timing."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import platform
import subprocess
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
REF_PYTHON = ROOT / ".venv-ref" / "bin" / "python"


def read_jsonl_records(path: pathlib.Path) -> list[dict]:
    """The records of a JSONL file at `path` or, when only that is there, at `path` + ".gz": runs write
    plain JSONL and the raw results kept in bench/results/ are stored gzipped (see its README).
    NaN/Infinity stay the strings the run wrote; the readers decode them."""
    gz = path.with_name(path.name + ".gz")
    if path.exists():
        text = path.read_text()
    elif gz.exists():
        text = gzip.decompress(gz.read_bytes()).decode()
    else:
        raise FileNotFoundError(f"{path}: neither it nor {gz.name} exists")
    return [json.loads(line) for line in text.splitlines() if line]


def torch_side(op: str, **request) -> dict:
    """Runs bench/torch_side.py in the reference venv (built by `AREAL_WITH_REFERENCE=1 source launch/env.sh`)."""
    if not REF_PYTHON.exists():
        raise SystemExit("the torch reference venv is missing: run `AREAL_WITH_REFERENCE=1 source launch/env.sh`")
    proc = subprocess.run([str(REF_PYTHON), str(ROOT / "bench" / "torch_side.py")], input=json.dumps(
        {"op": op, **request}), capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


class CompileClock:
    """Cumulative XLA backend compile seconds (all threads), from jax's monitoring events."""

    def __init__(self):
        import jax

        self._lock = threading.Lock()
        self.total_s = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            with self._lock:
                self.total_s += duration


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}"


def timed(fn, iters: int) -> float:
    """Mean seconds per call of `fn` (which must block until its result is ready), after one warm-up."""
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def measured_ceilings() -> dict[str, float]:
    """This machine's fp32 matmul FLOP/s and copy bytes/s through jax (for achieved-vs-ceiling figures)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((1024, 1024), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    t = timed(lambda: mm(a).block_until_ready(), 10)
    big = jnp.ones((64 << 20) // 4, jnp.float32)
    cp = jax.jit(lambda x: x + 1.0)
    tc = timed(lambda: cp(big).block_until_ready(), 10)
    return {"matmul_flops": 2 * 1024 ** 3 / t, "copy_bytes": 2 * big.nbytes / tc}


def qwen2_bench_config(layers: int = 8, hidden: int = 512, vocab: int = 8192) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                tie_word_embeddings=False, initializer_range=0.02)


def packed_rows(rng: np.random.Generator, rows: int, width: int, vocab: int, mean_len: int):
    """Rows of several sequences each: ids, segment ids `[R, W]` (no padding left over)."""
    ids = rng.integers(0, vocab, size=(rows, width)).astype(np.int32)
    seg = np.zeros((rows, width), np.int32)
    for r in range(rows):
        pos, k = 0, 1
        while pos < width:
            n = int(min(width - pos, max(8, rng.exponential(mean_len))))
            seg[r, pos:pos + n] = k
            pos, k = pos + n, k + 1
    return ids, seg
