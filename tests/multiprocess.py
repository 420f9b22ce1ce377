"""Runs a test's worker script as several real JAX processes on localhost (jax.distributed)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import portpicker

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_all(commands: list[list[str]], env: dict[str, str], *, timeout: float = 300) -> list[str]:
    """Runs the commands as concurrent processes from the repository root; returns each one's output.

    A process that fails has its output tail in the assertion message.
    """
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i][-4000:]}"
    return logs


def run_processes(worker: str | pathlib.Path, args_for: callable, out_dir: pathlib.Path, *, num_processes: int = 2,
                  devices_per_process: int = 4, timeout: float = 300) -> list[dict]:
    """Starts `worker PORT PROCESS_ID *args_for(i)` per process; returns each one's result JSON.

    Each worker writes `out_dir/result_<id>.json`.
    """
    port = portpicker.pick_unused_port()
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices_per_process), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    run_all([[sys.executable, str(worker), str(port), str(i), *map(str, args_for(i))] for i in range(num_processes)],
            env, timeout=timeout)
    return [json.loads((out_dir / f"result_{i}.json").read_text()) for i in range(num_processes)]


def run_cli_processes(args: list[str], *, num_processes: int = 2, devices_per_process: int = 1,
                      timeout: float = 400) -> list[str]:
    """`areal-jax ARGS` as `num_processes` local hosts (`devices_per_process` CPU devices each) over
    real jax.distributed; returns each process's output."""
    port = portpicker.pick_unused_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices_per_process)}
    return run_all([[sys.executable, "-m", "areal_jax.cli", *args, f"--coordinator=127.0.0.1:{port}",
                     f"--num_processes={num_processes}", f"--process_id={i}"] for i in range(num_processes)],
                   env, timeout=timeout)


def worker_main(body) -> None:
    """The shell of a worker script run by `run_processes`: argv is PORT PROCESS_ID NUM_PROCESSES
    *ARGS, the last of ARGS the output directory. Joins jax.distributed, runs `body(process_id,
    args)` (a dict of results), writes OUT_DIR/result_<id>.json with "ok" (and the traceback on
    failure) and exits 0 or 1."""
    import traceback

    port, process_id, num_processes, *args = sys.argv[1:]
    process_id = int(process_id)
    result = {"ok": False, "process_id": process_id}
    try:
        from areal_jax.parallel import initialize_distributed

        assert initialize_distributed(f"127.0.0.1:{port}", int(num_processes), process_id)
        result.update(body(process_id, args))
        result["ok"] = True
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr, flush=True)
    pathlib.Path(args[-1], f"result_{process_id}.json").write_text(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)
