"""Reward functions for the RewardPool tests, imported by path in worker processes."""

import os
import signal
import time


def add(a, b):
    return a + b


def constant_one(*args, **kwargs):
    return 1


def scaled(x, *, scale=1.0):
    return x * scale


def hang(seconds=3600.0):
    time.sleep(seconds)
    return 1.0


def exit_hard():
    os._exit(3)


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def segfault():
    import ctypes

    ctypes.string_at(0)


def boom(message="boom"):
    raise RuntimeError(message)


def not_a_number():
    return "1.0"


def nan():
    return float("nan")


def worker_pid():
    return float(os.getpid())


NOT_CALLABLE = 3


def sleep_then_pid(seconds):
    time.sleep(seconds)
    return float(os.getpid())


def sandboxed_sleep(seconds):
    """Runs a program that sleeps in the code sandbox (its wall clock well past `seconds`)."""
    from areal_jax.reward.sandbox import SandboxLimits, run_program

    run_program(f"import time\ntime.sleep({seconds})", "", SandboxLimits(wall_s=seconds + 30.0))
    return 1.0


def sandboxed_sleep_reward(text, gold):
    return sandboxed_sleep(600)


def catastrophic_regex(text, gold=None):
    """A backtracking regular expression: holds the GIL in C for hours (2^40 paths)."""
    import re

    return float(re.match(r"(a+)+$", "a" * 40 + "b") is not None)


def hang_sometimes(text, gold):
    """The arithmetic reward, except that about half of the completions (by a hash of the text)
    send it into a catastrophic regular expression instead."""
    import zlib

    from areal_jax.tasks.reward import arithmetic_reward

    if zlib.crc32(text.encode()) % 2:
        return catastrophic_regex(text)
    return arithmetic_reward(text, gold)


# Importing this module kills the importing process: a preload that crashes every worker.
CRASH_ON_IMPORT = "tests.reward_fixtures_crash_on_import"


def fork_child_and_daemon(pid_file, hang_s=0.0):
    """Starts a child that sleeps and a double-forked `setsid` daemon (it leaves the worker's session
    and its parent), writes "child daemon" pids to `pid_file`, then returns 1.0 after `hang_s`."""
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    r, w = os.pipe()
    first = os.fork()
    if first == 0:
        os.setsid()
        if os.fork():
            os._exit(0)
        os.write(w, str(os.getpid()).encode())
        time.sleep(600)
        os._exit(0)
    os.waitpid(first, 0)
    daemon = int(os.read(r, 64))
    with open(pid_file, "a") as f:
        f.write(f"{child} {daemon}\n")
    time.sleep(hang_s)
    return 1.0


def forking_reward(text, gold):
    """For `train`: the arithmetic reward, after leaving a child and a daemon behind (pids appended
    to $AREAL_TEST_PID_FILE)."""
    from areal_jax.tasks.reward import arithmetic_reward

    fork_child_and_daemon(os.environ["AREAL_TEST_PID_FILE"])
    return arithmetic_reward(text, gold)


def hog_memory(mb):
    """Holds `mb` MiB, touched, then returns 1.0."""
    blocks = [bytearray(1 << 20) for _ in range(mb)]
    return float(len(blocks) > 0)
