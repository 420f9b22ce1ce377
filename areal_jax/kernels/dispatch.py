"""Choosing a kernel by `impl` ("auto" | "reference" | "pallas") and platform: one table per operation."""

from __future__ import annotations

from collections.abc import Callable

import jax

IMPLS = ("auto", "reference", "pallas")


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
        backend), else "reference"; "pallas" with none registered is a one-line error."""
        if impl not in IMPLS:
            raise ValueError(f"{self.what} impl must be one of {IMPLS}, got {impl!r}")
        platform = platform or jax.default_backend()
        have = platform in self.kernels
        if impl == "pallas" and not have:
            raise ValueError(f"{self.what} impl 'pallas': no kernel for platform {platform!r} "
                             f"(have: {sorted(self.kernels)}); use 'reference' or 'auto'")
        return ("pallas" if have else "reference") if impl == "auto" else impl

    def kernel(self, platform: str | None = None) -> Callable[..., jax.Array]:
        return self.kernels[platform or jax.default_backend()]
