"""How `areal-jax` reports a failure that is not a bug in it: one line on stderr and an exit code.

    2   a problem with what the command was given: configuration (ConfigError), model, data, run or
        checkpoint directory (InputError, RunDirBusy), a missing optional package, a path that cannot
        be a directory or is not permitted, a reward or workflow that failed on every rollout of a
        step's worth (RolloutsFailed);
    74  storage: the disk is full, over quota or read-only (EX_IOERR of sysexits.h). The line names the
        path and the free space; every checkpoint finished before stays resumable (`--resume`);
    130 / 143  SIGINT / SIGTERM (cli.py).

Anything else is a bug and keeps its traceback (as does everything with --debug).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil

STORAGE_EXIT = 74
_STORAGE_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
                   errno.EROFS: "read-only file system"}
# Orbax's and TensorStore's errors carry the OS error as text only.
_STORAGE_TEXT = re.compile(r"No space left on device|Disk quota exceeded|Read-only file system", re.I)
_PATH_ERRNOS = (errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EACCES, errno.EPERM)


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _free_space(path: str | None) -> str:
    if not path or "://" in path:
        return "free space unknown"
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return "free space unknown"
    return f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.0f} MiB on {probe}"


def _path_in(text: str) -> str | None:
    """The first absolute path in an error's text that lies below an existing top-level directory
    (quoted ones first: TensorStore quotes the file; a key such as "/0.0.0" is not one)."""
    quoted = [a or b for a, b in re.findall(r'"(/[^"]+)"|\'(/[^\']+)\'', text)]
    bare = re.findall(r"(/[^\s'\"\],]+)", text)
    for path in quoted + bare:
        parts = path.split("/")
        if len(parts) > 2 and parts[1] and os.path.isdir("/" + parts[1]):
            return path
    return None


def user_error(e: BaseException, run_dir: str | None = None) -> tuple[str, int] | None:
    """(the line to print after "areal-jax: ", exit code) for a failure that is not a bug; else None."""
    from areal_jax.config_system import ConfigError
    from areal_jax.jobs.inputs import InputError

    if isinstance(e, InputError):
        return f"error: {_one_line(e)}", 2
    if isinstance(e, ConfigError):
        return f"configuration error: {_one_line(e)}", 2
    from areal_jax.rollout.controller import RolloutsFailed

    if isinstance(e, RolloutsFailed):  # a reward or workflow that fails on every row: the user's code
        return f"error: {_one_line(e)}", 2
    for cause in _chain(e):
        if isinstance(cause, OSError) and cause.errno in _STORAGE_ERRNOS:
            path = cause.filename or run_dir
            return (f"storage error: {path}: {_STORAGE_ERRNOS[cause.errno]} ({_free_space(path)}); "
                    "the checkpoints finished before stay resumable with --resume"), STORAGE_EXIT
        text = str(cause)
        found = _STORAGE_TEXT.search(text)
        if found:
            path = _path_in(text) or run_dir
            return (f"storage error: {path}: {found.group(0).lower()} ({_free_space(path)}); "
                    "the checkpoints finished before stay resumable with --resume"), STORAGE_EXIT
    if isinstance(e, OSError) and e.errno in _PATH_ERRNOS and e.filename:
        return f"error: {e.filename}: {e.strerror}", 2
    if isinstance(e, ImportError) and "pip install" in str(e):  # a missing extra, named by our own message
        return f"error: {_one_line(e)}", 2
    return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


class _StorageNoise(logging.Filter):
    """Drops the log records of a storage failure (Orbax logs each of its background threads' error
    with its traceback, hundreds of lines): the command reports it once, as its last line."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += " " + str(record.exc_info[1])
        return not _STORAGE_TEXT.search(text)


def quiet_storage_noise() -> None:
    """Installs the filter on the root logger's handlers (after logging.basicConfig)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_StorageNoise())
