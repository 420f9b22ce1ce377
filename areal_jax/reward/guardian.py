"""The guardian G of one reward pool worker (reward/containment.py draws the process tree): forks the
worker W and outlives it only to kill what W leaves, or everything below it when the pool's owner dies."""

from __future__ import annotations

import os
import signal

from areal_jax.reward.containment import (
    become_subreaper,
    cap_address_space,
    kill_descendants,
    signal_on_parent_death,
)
from areal_jax.reward.worker import release_fork_server, worker_main

__all__ = ["guardian_main"]


class _ParentDied(BaseException):
    pass


def _on_parent_death(signum, frame):
    raise _ParentDied()


def guardian_main(conn, preload, sandbox, memory_mb) -> None:
    """The pool's worker process: forks the worker W (reward/worker.py) and outlives it only to
    kill what W leaves. Exits with W's exit code (nonzero when W was killed or crashed)."""
    release_fork_server()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # shutdown is the pool's job
    signal.signal(signal.SIGTERM, _on_parent_death)
    signal_on_parent_death(signal.SIGTERM)
    become_subreaper()
    worker = os.fork()
    if worker == 0:  # W
        code = 1
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.setsid()
            become_subreaper()
            cap_address_space(memory_mb)
            worker_main(conn, preload, sandbox)
            code = 0
        finally:
            os._exit(code)
    conn.close()
    code = 1
    try:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)  # W, and orphans adopted from below it
            except ChildProcessError:
                break
            if pid == worker:
                code = os.waitstatus_to_exitcode(status)
                break
    except _ParentDied:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kill_descendants()
    os._exit(code if code >= 0 else 128 - code)
