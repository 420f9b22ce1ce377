"""Choosing a kernel by `impl` ("auto" | "reference" | "pallas") and platform: one table per operation.

Every attention entry point (flash attention for training and prefill, paged decode attention)
keeps its jnp reference and a `KernelTable` of its Pallas kernels by platform. The table answers
the same questions for each: which implementation `impl` resolves to on a platform, the kernel
itself, the name `plan --json` reports for it, whether it can take given shapes (`Kernel.limits`),
and any operation-specific property the kernel declares (`Kernel.layout`: the paged pool layout it
reads). The platform is the caller's, else the one `target_platform` set (a deviceless compile for
another target), else jax's default backend; "cuda" (the planner's GPU targets) is "gpu".
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import threading
from collections.abc import Callable, Iterator

import jax

IMPLS = ("auto", "reference", "pallas")
_ALIASES = {"cuda": "gpu"}  # jax.default_backend() says "gpu" where a GPU topology says "cuda"


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
    """`platform`, else the one `target_platform` set, else jax's default backend ("cuda" -> "gpu")."""
    platform = platform or _target.platform or jax.default_backend()
    return _ALIASES.get(platform, platform)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One platform's kernel of an operation: `fn` takes the reference's arguments (plus keyword
    options); `name` is what `plan --json` reports; `limits(*shape)` says why it cannot take those
    shapes (None: it can; the shape arguments are the operation's); `layout` is the data layout it
    reads where the operation has several (None otherwise)."""

    fn: Callable[..., jax.Array]
    name: str
    limits: Callable[..., str | None] | None = None
    layout: str | None = None


class KernelTable:
    """The Pallas kernels of one operation, by platform ("gpu", "tpu"); the jnp reference is the
    caller's. `what` names the operation in errors; `modules` maps a platform to the module that
    registers its kernel, imported on first use (a kernel module imports its operation's module)."""

    def __init__(self, what: str, modules: dict[str, str] | None = None):
        self.what = what
        self.kernels: dict[str, Kernel] = {}
        self._modules = dict(modules or {})

    def register(self, platform: str, fn: Callable[..., jax.Array], *, name: str,
                 limits: Callable[..., str | None] | None = None, layout: str | None = None) -> None:
        self.kernels[current_platform(platform)] = Kernel(fn, name, limits, layout)

    def entry(self, platform: str | None = None) -> Kernel | None:
        """The kernel registered for `platform` (importing its module on first use), or None."""
        platform = current_platform(platform)
        if platform not in self.kernels and platform in self._modules:
            importlib.import_module(self._modules[platform])
        return self.kernels.get(platform)

    def resolve(self, impl: str, platform: str | None = None) -> str:
        """"auto" -> "pallas" where a kernel is registered for the platform, else "reference";
        "pallas" with none registered is a one-line error."""
        if impl not in IMPLS:
            raise ValueError(f"{self.what} impl must be one of {IMPLS}, got {impl!r}")
        have = self.entry(platform) is not None
        if impl == "pallas" and not have:
            raise ValueError(f"{self.what} impl 'pallas': no kernel for platform {current_platform(platform)!r} "
                             f"(have: {sorted(self.kernels) or 'none'}); use 'reference' or 'auto'")
        return ("pallas" if have else "reference") if impl == "auto" else impl

    def kernel(self, platform: str | None = None) -> Callable[..., jax.Array]:
        return self.entry(platform).fn

    def kernel_name(self, impl: str, platform: str | None = None) -> str:
        """What the operation compiles for `impl` on the platform: "reference" or the kernel's name."""
        return "reference" if self.resolve(impl, platform) == "reference" else self.entry(platform).name

    def unfit(self, platform: str | None, *shape) -> str | None:
        """Why the platform's kernel cannot take `shape` (its `limits`), or None."""
        limits = self.entry(platform).limits
        return limits(*shape) if limits is not None else None
