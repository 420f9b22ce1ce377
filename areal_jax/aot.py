"""Ahead-of-time descriptions of the programs a run executes, for planning without hardware.

A `ProgramSpec` names one jitted program at the shapes a config gives it: its abstract
arguments (`jax.ShapeDtypeStruct`s carrying their shardings, so nothing is allocated) and the
arrays that stay resident on the same devices while it runs without being its arguments (the
optimizer state during a gradient micro-batch). The modules that own the programs
(trainer/programs.py, generation/programs.py, parallel/weight_sync.py) list their specs; the
planner (areal_jax/plan/) lowers, compiles and measures them. This module imports nothing of
the system above it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ContextManager, Literal

import jax
import numpy as np

from areal_jax.kernels import dispatch  # kernels chosen for the target platform while tracing

Role = Literal["train", "generation", "transfer", "eval", "reward"]
ROLES: tuple[str, ...] = ("train", "generation", "transfer", "eval", "reward")


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """One compiled program of a run, at its real shapes.

    Attributes:
        name: unique and readable, shapes included, e.g. "train/grad[rows=8,len=2048]".
        role: which devices run it ("transfer" runs on the training devices; "reward": a learned
            reward's, on the reward devices or beside the generation engine).
        fn: the `jax.jit`-wrapped function the run calls.
        args, kwargs: as the run passes them, with arrays replaced by ShapeDtypeStructs
            (sharded) and static arguments as their Python values.
        resident: arrays (ShapeDtypeStructs) that occupy the same devices while it runs but are
            not its arguments; counted into its peak.
        context: entered while tracing (e.g. the activation sharding rules of its mesh).
        fields: the config fields that size this program, named when it does not fit.
    """

    name: str
    role: Role
    fn: Any
    args: tuple = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    resident: tuple = ()
    context: Callable[[], ContextManager] | None = None
    fields: tuple[str, ...] = ()

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"ProgramSpec {self.name!r}: role must be one of {ROLES}, got {self.role!r}")

    def lower(self) -> jax.stages.Lowered:
        with (self.context() if self.context is not None else contextlib.nullcontext()):
            with target_device_context((self.args, dict(self.kwargs))):
                return self.fn.lower(*self.args, **self.kwargs)


@contextlib.contextmanager
def target_device_context(tree: Any) -> Iterator[None]:
    """Traces as for the arguments' (fake, target) devices: under their abstract mesh unless a mesh
    is set (Pallas kernels read the device kind they compile for from it, GPU compute capability or
    TPU generation, and would otherwise ask the host's CPU), and with kernels chosen for their
    platform where `kernels.dispatch` chooses them ("auto" would otherwise pick the host's)."""
    mesh = next((m for x in jax.tree.leaves(tree)
                 if isinstance(m := getattr(getattr(x, "sharding", None), "mesh", None), jax.sharding.Mesh)
                 and m.devices.flat[0].platform != "cpu"), None)
    if mesh is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        if jax.sharding.get_abstract_mesh().empty:
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
        stack.enter_context(dispatch.target_platform(mesh.devices.flat[0].platform))
        yield


def abstract(tree: Any, shardings: Any = None) -> Any:
    """ShapeDtypeStructs of a pytree of arrays (or of ShapeDtypeStructs), optionally re-sharded."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# Bits of the sub-byte dtypes XLA packs in device memory (NumPy's itemsize says 1 byte for them).
_SUB_BYTE_BITS = {"int4": 4, "uint4": 4, "int2": 2, "uint2": 2, "float4_e2m1fn": 4}


def dtype_bits(dtype: Any) -> int:
    """Bits one element of `dtype` takes in device memory (jnp.int4: 4)."""
    dt = np.dtype(dtype)
    return _SUB_BYTE_BITS.get(dt.name, dt.itemsize * 8)


def bytes_per_device(tree: Any) -> int:
    """Bytes the largest shard of each array takes on one device, summed over the pytree.

    An array without a sharding counts whole (it lives on one device); other leaves count 0."""
    total = 0
    for x in jax.tree.leaves(tree):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            continue  # static arguments (ints, strings) occupy no device memory
        shape = tuple(x.shape)
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            shape = tuple(sharding.shard_shape(shape))
        total += -(-math.prod(shape) * dtype_bits(x.dtype) // 8)  # jnp.int4: packed, half a byte
    return total
