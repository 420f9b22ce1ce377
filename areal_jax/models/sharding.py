"""Logical axis names -> mesh axes, by one rule table per mesh (MaxText-style).

Every parameter carries a tuple of logical axis names (its `axes` metadata); activations are
constrained with `constrain(x, names)`. A rule table maps each logical name to a mesh axis (or
None = replicated). Mesh axes are fixed project-wide:
  train mesh       ("fsdp", "expert", "tensor")   global over every host's training devices
  generation mesh  ("data", "expert", "tensor")   host-local over this host's generation devices
("expert" splits a MoE model's experts; in training it also carries data parallelism for the rest.)
A dimension whose size the mesh axis does not divide is replicated instead (e.g. 2 kv heads on
tensor=4), so any checkpoint loads onto any mesh.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Mapping[str, str | tuple[str, ...] | None]

TRAIN_RULES: Rules = {
    # Rows and the non-expert weights shard over "expert" too: for everything but the experts the
    # expert axis is more data parallelism (parallel/meshes.py); the expert block's shard_map
    # gathers a layer's tokens over it and sums the experts' outputs back (models/moe.py).
    "batch": ("fsdp", "expert"),
    "seq": None,
    "layers": None,
    "vocab": "tensor",
    "embed": ("fsdp", "expert"),
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    # Mixture of experts (models/moe.py): experts split over an "expert" mesh axis where the mesh
    # has one (each shard computes its experts' tokens), each expert's hidden units over tensor.
    "experts": "expert",
    "moe_mlp": "tensor",
    "shared_mlp": "tensor",
    "router": None,
    "shared_gate": None,
}

GENERATION_RULES: Rules = {
    **TRAIN_RULES,
    # Within a replica only the experts split over "expert"; rows, KV cache and the other weights
    # are replicated over it (a replica's decode batch is small: gathering it costs little).
    "batch": "data",
    "embed": None,  # generation keeps weights whole per data replica: no per-step all-gathers
    "cache_slots": "data",
    "cache_seq": None,
}


def spec_for(axes: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None
             ) -> PartitionSpec:
    """PartitionSpec for one array with logical `axes`; replicates dims the mesh axis doesn't divide."""
    out, used = [], set()
    for i, name in enumerate(axes):
        mesh_axis = rules.get(name) if name is not None else None
        if mesh_axis is not None:
            names = (mesh_axis,) if isinstance(mesh_axis, str) else tuple(mesh_axis)
            names = tuple(n for n in names if n in mesh.shape and n not in used)
            size = 1
            for n in names:
                size *= mesh.shape[n]
            if not names or size == 1 or (shape is not None and shape[i] % size):
                mesh_axis = None
            else:
                used.update(names)
                mesh_axis = names[0] if len(names) == 1 else names
        out.append(mesh_axis)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def sharding_for(axes, rules: Rules, mesh: Mesh, shape=None) -> NamedSharding:
    return NamedSharding(mesh, spec_for(axes, rules, mesh, shape))


class _Active(threading.local):
    rules: Rules | None = None
    mesh: Mesh | None = None


_active = _Active()


@contextlib.contextmanager
def activation_rules(rules: Rules, mesh: Mesh):
    """Within this block (per thread: the rollout and trainer threads use different meshes),
    `constrain` pins activations to `mesh` by `rules`; outside it `constrain` is a no-op."""
    prev = (_active.rules, _active.mesh)
    _active.rules, _active.mesh = rules, mesh
    try:
        yield
    finally:
        _active.rules, _active.mesh = prev


def active() -> tuple[Rules, Mesh] | None:
    """The (rules, mesh) of the enclosing `activation_rules` block, or None outside one."""
    if _active.rules is None or _active.mesh is None:
        return None
    return _active.rules, _active.mesh


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical axis names (no-op without active rules)."""
    if _active.rules is None or _active.mesh is None:
        return x
    spec = spec_for(axes, _active.rules, _active.mesh, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(_active.mesh, spec))
