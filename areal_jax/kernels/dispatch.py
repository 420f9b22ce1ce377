"""Choosing a kernel by `impl` ("auto" | "reference" | "pallas") and platform: one table per operation."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import jax

IMPLS = ("auto", "reference", "pallas")


class _Target(threading.local):
    platform: str | None = None


_target = _Target()


@contextlib.contextmanager
def target_platform(platform: str) -> Iterator[None]:
    """Within this block (per thread) kernels are chosen for `platform` ("gpu", "tpu") instead of
    jax's default backend: what a deviceless compile for another target (`plan`) needs."""
    prev, _target.platform = _target.platform, platform
    try:
        yield
    finally:
        _target.platform = prev


def current_platform(platform: str | None = None) -> str:
    """`platform`, else the one `target_platform` set, else jax's default backend."""
    return platform or _target.platform or jax.default_backend()


class KernelTable:
    """The Pallas kernels of one operation, by platform ("gpu", "tpu"); the jnp reference is the
    caller's. `what` names the operation in errors."""

    def __init__(self, what: str):
        self.what = what
        self.kernels: dict[str, Callable[..., jax.Array]] = {}

    def register(self, platform: str, kernel: Callable[..., jax.Array]) -> None:
        self.kernels[platform] = kernel

    def resolve(self, impl: str, platform: str | None = None) -> str:
        """"auto" -> "pallas" where a kernel is registered for `platform` (default: jax's default
        backend, or `target_platform`'s), else "reference"; "pallas" with none registered is a
        one-line error."""
        if impl not in IMPLS:
            raise ValueError(f"{self.what} impl must be one of {IMPLS}, got {impl!r}")
        platform = current_platform(platform)
        have = platform in self.kernels
        if impl == "pallas" and not have:
            raise ValueError(f"{self.what} impl 'pallas': no kernel for platform {platform!r} "
                             f"(have: {sorted(self.kernels)}); use 'reference' or 'auto'")
        return ("pallas" if have else "reference") if impl == "auto" else impl

    def kernel(self, platform: str | None = None) -> Callable[..., jax.Array]:
        return self.kernels[current_platform(platform)]
