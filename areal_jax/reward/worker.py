"""The worker side of `RewardPool`: a loop that imports reward functions by path and runs them.

Kept apart from the supervisor so a worker imports only this, the registry and the sandbox
before its preload modules.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.connection
import os
import signal
import traceback
from typing import Any

from areal_jax.reward.containment import has_children, kill_descendants
from areal_jax.reward.registry import load_reward_function, reward_value
from areal_jax.reward.sandbox import SandboxLimits, set_default_limits

__all__ = ["release_fork_server", "worker_main"]


def _die_with_parent() -> None:
    # A forkserver child's parent is the fork server, which exits when the pool's process
    # dies; PR_SET_PDEATHSIG then takes a worker stuck in a hung call down with it.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def release_fork_server() -> None:
    # A forkserver child inherits the write end of the pipe on which the fork server waits for the
    # pool's process to die (multiprocessing keeps it so a child could start processes itself).
    # Held by a worker stuck in a call, the server never sees that end and never exits, so the
    # worker's parent-death signal never comes: a SIGKILLed trainer would leave both behind.
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None


def worker_main(conn: multiprocessing.connection.Connection, preload: tuple[str, ...],
                sandbox: SandboxLimits | None = None) -> None:
    """Worker loop: receive (task_id, path, args, kwargs), reply (task_id, status, payload)."""
    _die_with_parent()
    release_fork_server()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # shutdown is the parent's job
    if sandbox is not None:
        set_default_limits(sandbox)
    for module in preload:
        try:
            __import__(module)
        except Exception:  # a broken preload must not stop the pool; calls will report it
            logging.getLogger(__name__).warning("reward worker failed to preload %s", module, exc_info=True)
    conn.send(("ready", os.getpid(), None))
    functions: dict[str, Any] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        task_id, path, args, kwargs = message
        if path not in functions:
            try:
                functions[path] = load_reward_function(path)
            except Exception:
                conn.send((task_id, "not_found", traceback.format_exc()))
                continue
        fn = functions[path]
        out_of_memory = False
        try:
            reply = (task_id, "ok", reward_value(fn(*args, **kwargs), path))
        except MemoryError:  # past RewardPoolConfig.memory_mb: an error, and this worker retires
            out_of_memory = True
            reply = (task_id, "out_of_memory", "MemoryError: the reward exceeded RewardPoolConfig.memory_mb")
        except Exception:
            reply = (task_id, "error", traceback.format_exc())
        # Whatever the call started ends with it (this process is their subreaper: reward/containment.py).
        if has_children():
            kill_descendants()
        conn.send(reply)
        if out_of_memory:
            return
