"""Run and checkpoint directories on any storage Orbax writes to: local disk or gs:// (any scheme
`etils.epath` knows).

Paths are `etils.epath.Path`, Orbax's own path type: local ones behave as pathlib's, remote ones
go through fsspec (gcsfs for gs://, installed with the `[gcs]` extra) while Orbax writes the
arrays through TensorStore's own GCS driver. `pathlib.Path("gs://b/run")` would silently become the
local directory `gs:/b/run`, so nothing here hands a remote path to pathlib, os or shutil.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from etils import epath

Path = epath.Path
PathLike = str | os.PathLike


def as_path(path: PathLike) -> epath.Path:
    """`path` as an epath.Path, local paths left as given (relative stays relative)."""
    return epath.Path(path)


def is_remote(path: PathLike) -> bool:
    """Whether `path` names an object store (gs://, s3://, ...) rather than the local disk."""
    return "://" in os.fspath(path)


def absolute(path: PathLike) -> epath.Path:
    """A local path made absolute (Orbax requires it); a remote one unchanged."""
    path = as_path(path)
    return path if is_remote(path) else path.absolute()


def write_whole(path: PathLike, data: str | bytes) -> None:
    """Writes `data` so that it appears whole: a reader, or another process writing the same file,
    never sees it half-written. Locally: written beside it, then renamed; an object store's
    upload is already all-or-nothing."""
    path = as_path(path)
    if is_remote(path):
        target = path
    else:
        target = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if isinstance(data, bytes):
            target.write_bytes(data)
        else:
            target.write_text(data)
        if target != path:
            os.replace(target, path)
    except BaseException:  # a full or read-only disk: no half-written sibling left behind
        if target != path:
            with contextlib.suppress(OSError):
                os.unlink(target)
        raise


def remove(path: PathLike) -> None:
    """Removes a file or a directory tree (nothing if absent)."""
    path = as_path(path)
    if path.is_dir():
        path.rmtree()
    elif path.exists():
        path.unlink()


def copy_files(src: PathLike, dst: PathLike, names: list[str] | None = None) -> None:
    """Copies the files directly in `src` (or only `names`) into `dst`, across storages."""
    src, dst = as_path(src), as_path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in ([src / n for n in names] if names is not None else list(src.iterdir())):
        if not f.is_dir():
            (dst / f.name).write_bytes(f.read_bytes())


@contextlib.contextmanager
def staged_dir(target: PathLike) -> Iterator[epath.Path]:
    """Yields a directory to fill; on success it becomes `target` (an existing one is replaced),
    on failure it is removed. Locally the directory appears complete or not at all (a sibling
    renamed into place); an object store has no directory rename, so there it is written in place."""
    target = as_path(target)
    if is_remote(target):
        remove(target)
        yield target
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_stages(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        tmp.mkdir()
        yield tmp
        if target.exists():
            # rename() cannot replace a non-empty directory: move the old one aside first.
            old = target.parent / f".{target.name}.old-{os.getpid()}-{time.monotonic_ns()}"
            target.rename(old)
            tmp.rename(target)
            remove(old)
        else:
            tmp.rename(target)
    finally:
        remove(tmp)


def _remove_stale_stages(target: epath.Path) -> None:
    """Removes the hidden siblings a killed writer of `target` left (`.NAME.tmp-PID-*`, partial
    contents; `.NAME.old-PID-*`, a replaced copy not yet removed) whose PID no longer runs here.
    A live writer's are kept: two writers of one target each finish their own."""
    prefixes = (f".{target.name}.tmp-", f".{target.name}.old-")
    for entry in target.parent.iterdir():
        prefix = next((p for p in prefixes if entry.name.startswith(p)), None)
        pid = entry.name[len(prefix):].split("-", 1)[0] if prefix else ""
        if pid.isdigit() and not _pid_alive(int(pid)):
            remove(entry)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone; a pid no process can have
        return False
    except PermissionError:  # another user's process
        return True
    return True


def check_reachable(path: PathLike, field: str) -> None:
    """Raises ValueError naming `field` when `path` is remote and no filesystem for its scheme is
    installed (gs:// needs gcsfs, which also brings the google-cloud-storage client Orbax uses to
    delete old steps): said before any work, not at the first write."""
    if not is_remote(path):
        return
    import fsspec

    scheme = os.fspath(path).split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as e:
        hint = "pip install 'areal-jax[gcs]'" if scheme in ("gs", "gcs") else f"install fsspec's {scheme} filesystem"
        raise ValueError(f"{field} = {os.fspath(path)}: {e} ({hint})") from None
