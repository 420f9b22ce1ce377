"""The generation engine's compiled programs (their ahead-of-time descriptions for the planner:
generation/program_specs.py).

`build_programs` jits every program `GenerationEngine` runs, from (model config, engine config,
cache dtype) alone: admission (`prefill_start`: prefill, copy into slots, first tokens), the kept
block's later samples (`insert`, `first_tokens`), the decode chunk, the re-prefill after a weight
swap (`reprefill`: packed histories straight into their slots; `prefill` + `insert` for histories
longer than a packed row) and the change of the weights' layout to the served one.
`engine_program_specs` (generation/program_specs.py) describes the same programs at a config's
shapes for the planner.

Engine state on the generation mesh ("data", "tensor"): the KV cache as L per-layer buffers
`[B, K, S, H]` (slots over "data", kv heads over "tensor"), or paged as L per-layer page pools
(pages over "data", kv heads over "tensor"; generation/paged.py), the page tables `[B, M]` then
the last argument of every program that writes or reads the cache, and the weights split per layer
(`split_layers`), each laid out by GENERATION_RULES. With EngineConfig.scan_layers (paged only) the
weights stay stacked and the cache is one stacked pool: every program runs its layers as a scan.
`check_mesh` refuses shapes the mesh would silently replicate: slots not divisible by "data", kv
heads not divisible by "tensor".

Shapes: B slots, S cache length, R prefill rows, P prompt bucket, W decode window, V vocab.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, Sharding

from areal_jax.generation.config import EngineConfig, round_slots
from areal_jax.generation.paged import insert_pages, insert_pages_stacked, make_attend, make_ride_attend
from areal_jax.generation.sampling import sample_tokens
from areal_jax.models import moe, quantize
from areal_jax.models.config import ModelConfig
from areal_jax.models.sharding import GENERATION_RULES, constrain, sharding_for
from areal_jax.models.decoding import (RideRows, paged_decode_step, prefill_block, prefill_into_pages,
                                       prefill_into_slots, prefill_trie_into_pages, prefill_trie_into_slots)
from areal_jax.models.transformer import (KVCache, Params, forward, lm_head, param_axes, param_shapes, split_layers,
                                          stack_layers)

CACHE_AXES = ("cache_slots", "kv_heads", "cache_seq", "head_dim")  # one cache layer [B, K, S, H]
LOGITS_AXES = ("batch", "act_vocab")  # a prefill's last-position logits [R, V]


# ---- layouts on the generation mesh ----------------------------------------------------------------


def mesh_sizes(mesh: Mesh | None) -> tuple[int, int]:
    """(data, tensor) sizes of a generation mesh; (1, 1) for a single device."""
    if mesh is None:
        return 1, 1
    return mesh.shape.get("data", 1), mesh.shape.get("tensor", 1)


def mesh_of(params: Params) -> Mesh | None:
    """The generation mesh the weights lie on (where the engine runs), or None on a single device."""
    home = params["embed"].sharding
    return home.mesh if isinstance(home, NamedSharding) else None


def slots_for_replicas(slots: int, params: Params) -> int:
    """`slots` rounded up to a multiple of the data replicas of the weights' mesh (1 on a single
    device): the engine gives every replica the same share, so none holds more than `slots` would
    on one device."""
    return round_slots(slots, mesh_sizes(mesh_of(params))[0])


def unsplit_tensor_axes(model_cfg: ModelConfig, tensor: int) -> dict[str, int]:
    """The weights' logical axes GENERATION_RULES shards over "tensor" whose size `tensor` does not
    divide, with their sizes ({"kv_heads": 2} for 2 kv heads at tensor 4): `spec_for` would keep
    those weights whole on every device of a replica instead."""
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
    axes = jax.tree.leaves(param_axes(model_cfg), is_leaf=is_axes)
    shapes = jax.tree.leaves(param_shapes(model_cfg), is_leaf=lambda x: isinstance(x, tuple))
    return {name: size for leaf_axes, shape in zip(axes, shapes) for name, size in zip(leaf_axes, shape)
            if GENERATION_RULES.get(name) == "tensor" and size % tensor}


def check_mesh(model_cfg: ModelConfig, engine_cfg: EngineConfig, mesh: Mesh | None) -> None:
    """Raises ValueError where the engine's state would be replicated instead of sharded."""
    data, tensor = mesh_sizes(mesh)
    if engine_cfg.num_slots % data:
        raise ValueError(f"EngineConfig.num_slots = {engine_cfg.num_slots} must be a multiple of the generation "
                         f"mesh's data size {data}: each data replica holds num_slots / {data} slots (otherwise "
                         "the whole KV cache is replicated on every device)")
    if model_cfg.num_kv_heads % tensor:
        raise ValueError(f"MeshConfig.generation_tensor = {tensor} does not divide the model's "
                         f"{model_cfg.num_kv_heads} kv heads: the KV cache would be replicated over \"tensor\" "
                         f"(choose a generation_tensor that divides {model_cfg.num_kv_heads})")


def cache_sharding(model_cfg: ModelConfig, engine_cfg: EngineConfig, mesh: Mesh) -> NamedSharding:
    """Sharding of one cache layer `[B, K, S, H]`."""
    shape = (engine_cfg.num_slots, model_cfg.num_kv_heads, engine_cfg.max_seq_len, model_cfg.head_dim)
    return sharding_for(CACHE_AXES, GENERATION_RULES, mesh, shape)


def param_shardings(model_cfg: ModelConfig, mesh: Mesh, *, split: bool, weight_dtype: str | None = None) -> Any:
    """Sharding of every weight on the generation mesh: stacked (`params["layers"]` a dict of
    `[L, ...]` arrays) or split (a tuple of L per-layer dicts, the layout the engine holds). With
    `weight_dtype` "int8" or "int4" (EngineConfig.weight_dtype) the quantized weights get a
    QuantizedWeight of the codes' and the scales' shardings."""
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
    axes, shapes = param_axes(model_cfg), param_shapes(model_cfg)
    out = jax.tree.map(lambda a, s: sharding_for(a, GENERATION_RULES, mesh, s), axes, shapes, is_leaf=is_axes)
    if split:
        layer = jax.tree.map(lambda a, s: sharding_for(a[1:], GENERATION_RULES, mesh, s[1:]), axes["layers"],
                             shapes["layers"], is_leaf=is_axes)
        out["layers"] = (layer,) * model_cfg.num_layers
    if weight_dtype is not None:
        layer_shapes = shapes["layers"]  # stacked [L, ...]: a per-layer weight drops the first axis
        out = quantize.map_quantized(out, lambda sh, axes, name: quantize.quantized_sharding(
            sh, axes, weight_dtype, layer_shapes[name][1:] if split else layer_shapes[name]))
    return out


def param_structs(model_cfg: ModelConfig, mesh: Mesh, dtype, *, split: bool, weight_dtype: str | None = None) -> Any:
    """ShapeDtypeStructs of the weights, laid out as `param_shardings` says; with `weight_dtype`
    "int8" / "int4" the quantized weights as their codes and scales (`models/quantize.py`)."""
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(a, int) for a in x)  # noqa: E731
    shapes = param_shapes(model_cfg)
    if split:
        shapes = {**shapes, "layers": (jax.tree.map(lambda s: s[1:], shapes["layers"], is_leaf=is_shape),)
                  * model_cfg.num_layers}
    structs = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s, dtype, sharding=sh), shapes,
                           param_shardings(model_cfg, mesh, split=split), is_leaf=is_shape)
    return structs if weight_dtype is None else quantize.map_quantized(
        structs, lambda st, axes, _: quantize.quantized_struct(st, axes, weight_dtype))


# ---- the programs ------------------------------------------------------------------------------------


def program_name(kind: str, **dims: int) -> str:
    """"prefill_start[rows=4,len=64]": a program and the shape it was compiled for."""
    return kind + ("[" + ",".join(f"{k}={v}" for k, v in dims.items()) + "]" if dims else "")


def insert_rows(cache: KVCache, block: KVCache, rows: jax.Array, slots: jax.Array) -> KVCache:
    """Block row rows[i] into cache slot slots[i], positions [0, P): block layers `[R, K, P, H]`,
    cache layers `[B, K, S, H]`, index arrays `[B]` padded with slot B (out of range: dropped), so
    one program per block shape."""
    def put(layers, src):
        return tuple(dst.at[slots, :, :part.shape[2]].set(part[rows], mode="drop") for dst, part in zip(layers, src))

    return KVCache(put(cache.k, block.k), put(cache.v, block.v))


def sample_rows(logits: jax.Array, rows: jax.Array, key_data: jax.Array, positions: jax.Array,
                temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """First token of each started sample from its prompt row's logits `[R, V]`; per-sample `[B]`
    inputs. The key is the sample's folded with its prompt's last position, as in decoding."""
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key_data), positions)
    return sample_tokens(logits[rows], keys, temperature, top_p, top_k)


def carry_state(last: tuple[jax.Array, ...], last_slots: jax.Array, host: tuple[jax.Array, ...], fresh: jax.Array,
                order: jax.Array, real: jax.Array) -> tuple[jax.Array, ...]:
    """The next decode chunk's (tokens, positions, active, remaining) `[B']` for batch rows `order`
    (slots; `real` False: a padding row, inactive), on the device: each slot's from the last chunk's
    final state `last` (`[B_last]`, row j holding slot last_slots[j], B for a padding row), unless
    the host has changed the slot since that chunk was dispatched (`fresh [B]`: started, finished,
    preempted), where the host's `[B]` arrays hold it. So a chunk is dispatched before the last one's
    tokens are read back."""
    out = []
    for prev, mine in zip(last, host, strict=True):
        merged = jnp.where(fresh, mine, mine.at[last_slots].set(prev, mode="drop"))
        out.append(merged[order])
    out[2] = out[2] & real
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class EnginePrograms:
    """The jitted programs of one engine. `counts` counts traces per kind (one per compilation),
    `traced` per `program_name` (the shapes the engine actually compiled)."""

    split: Any  # weights -> the served layout (per layer, or stacked with scan_layers), once per swap
    prefill_start: Any  # (params, cache*, tokens, lengths, rows, slots, keys, positions, T, top_p, top_k)
    insert: Any  # (cache*, block, rows, slots) -> cache
    first_tokens: Any  # (logits, rows, keys, positions, T, top_p, top_k) -> (tokens, logprobs)
    prefill: Any  # (params, tokens, lengths) -> block: histories longer than a packed row
    # (params, cache*, tokens, segment_ids, slot_ids) -> cache; with reprefill_share_prefixes
    # (params, cache*, TrieRows) -> cache
    reprefill: Any
    decode: Any  # (params, cache*, per-slot state..., exit_free, *, window, sampler) -> (cache, outputs)
    # paged, with reprefill_in_decode_rows: decode whose steps carry re-prefill rows (after the page
    # tables: RideRows of [C, R, W] / [C, R, M], ride_steps); None otherwise
    decode_ride: Any
    carry: Any  # (last chunk's state, its slots, host state, fresh, next order) -> next chunk's state
    counts: collections.Counter
    traced: collections.Counter
    # "dense" or "paged". Paged programs take the cache as L per-layer `PagePool`s and the page
    # tables `[B, M]` as their last argument; their insert also takes each row's length before them.
    layout: str = "dense"
    # Stacked weights, one stacked pool and `[L, R, K, P, H]` blocks; every program scans its layers.
    scan_layers: bool = False


def block_dims(block: KVCache) -> tuple[int, int]:
    """(rows, positions) of a prefill block, per layer or stacked."""
    shape = block.k[0].shape if block.is_per_layer else block.k.shape[1:]
    return shape[0], shape[2]


# XLA:GPU copies a slice of a stacked weight before a Triton GEMM reads it; a cuBLAS GEMM reads it in
# place through dynamic-slice fusion. What a scanned engine's programs compile with on GPU.
SCAN_GPU_OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_enable_triton_gemm": False}


def build_programs(model_cfg: ModelConfig, engine_cfg: EngineConfig, cache_dtype, *, mesh: Mesh | None = None,
                   counts: collections.Counter | None = None, platform: str | None = None) -> EnginePrograms:
    """Jits the engine's programs (`*`: donated cache). With `mesh`, the weight split lays its
    output out by the generation rules; trace them under `activation_rules(GENERATION_RULES, mesh)`.
    `platform` ("cpu", "gpu", "tpu"; default: jax's default backend): the target the programs are
    for, which resolves `kv_layout` "auto" and the paged attention kernel."""
    cfg, ec = model_cfg, engine_cfg
    layout = ec.layout(platform or jax.default_backend())
    scan = ec.scan_layers and layout == "paged"
    L = cfg.num_layers
    exit_every = ec.exit_every(platform or jax.default_backend())
    data = mesh_sizes(mesh)[0]
    cache_dtype = jnp.dtype(cache_dtype)
    counts = collections.Counter() if counts is None else counts
    traced: collections.Counter = collections.Counter()

    # Prefill and re-prefill attend by the platform's kernels where attention_impl resolves to them
    # (kernels/prefill_attention.py for a prompt's chunks, kernels/flash_attention.py for packed
    # histories), as decode does by the paged kernel.
    attention = dict(attention_impl=ec.attention_impl, platform=platform)

    # MoE models: prefill and decode also return the experts each token was routed to, `[..., L_moe,
    # k]` (models/moe.py `record`), which the engine keeps per token for routing replay.
    record = cfg.moe is not None

    def prefill_logits(params, tokens, lengths):
        """KV block (L x `[R, K, P, H]`), last-prompt-position logits `[R, V]` and (MoE) the prompt
        tokens' experts `[R, P, L_moe, k]` (else None): only the last position needs logits (the
        LM head over all P would be ~40% of a small model's prefill)."""
        block, last, *chosen = prefill_block(params, cfg, tokens, lengths, chunk=ec.prefill_chunk,
                                             cache_dtype=cache_dtype, return_routing=record, scan_layers=scan,
                                             **attention)
        return block, constrain(lm_head(params, cfg, last[:, None])[:, 0], LOGITS_AXES), (chosen or [None])[0]

    def insert(cache, block, rows, slots):
        R, P = block_dims(block)
        traced[program_name("insert", rows=R, len=P)] += 1
        return insert_rows(cache, block, rows, slots)

    def first_tokens(all_logits, rows, key_data, positions, temperature, top_p, top_k):
        traced[program_name("first_tokens", rows=all_logits.shape[0])] += 1
        return sample_rows(all_logits, rows, key_data, positions, temperature, top_p, top_k)

    def prefill_start(params, cache, tokens, lengths, rows, slots, key_data, positions, temperature, top_p, top_k):
        """Prefill, copy row rows[i] into slot slots[i] and sample that sample's first token:
        admission in one program (three calls and host round trips otherwise). Last: the prompt
        rows' experts `[R, P, L_moe, k]` (MoE) or None."""
        counts["prefill"] += 1
        traced[program_name("prefill_start", rows=tokens.shape[0], len=tokens.shape[1])] += 1
        block, logits, chosen = prefill_logits(params, tokens, lengths)
        first, logprobs = sample_rows(logits, rows, key_data, positions, temperature, top_p, top_k)
        return insert_rows(cache, block, rows, slots), block, logits, first, logprobs, chosen

    def prefill(params, tokens, lengths):
        traced[program_name("prefill", rows=tokens.shape[0], len=tokens.shape[1])] += 1
        block, _ = prefill_block(params, cfg, tokens, lengths, chunk=ec.prefill_chunk, cache_dtype=cache_dtype,
                                 scan_layers=scan, **attention)
        return block

    def reprefill(params, cache, tokens, segment_ids, slot_ids):
        counts["reprefill"] += 1
        traced[program_name("reprefill_packed", rows=tokens.shape[0])] += 1
        return prefill_into_slots(params, cfg, tokens, segment_ids, slot_ids, cache, **attention)

    def reprefill_trie(params, cache, trie):
        counts["reprefill"] += 1
        traced[program_name("reprefill_packed", rows=trie.input_ids.shape[0])] += 1
        return prefill_trie_into_slots(params, cfg, trie, cache, **attention)

    def decode_loop(model_step, cache, tokens, positions, active, remaining, temperature, top_p, top_k, stop_ids,
                    key_data, exit_free, *, sampler, exit_every, min_steps=0):
        """Up to `decode_chunk` steps for all slots; stops after the step that leaves every slot
        done or at least `exit_free` slots free. Outputs `[B, C]`; steps past the exit are invalid.
        `model_step(cache, tokens [B], positions [B], step, go) -> (logits [B, V], cache, experts)`,
        position -1 for an inactive slot (nothing written); `step` the step's index in the chunk and
        `go` whether it runs (a fixed-count loop's tail does not); experts `[B, L_moe, k]` of the input tokens (MoE;
        else None) come out as a fifth output `[B, C, L_moe, k]` (else None); the sixth is the slots'
        state after the chunk (tokens, positions, active, remaining `[B]`, left on the device: the
        next chunk can start from it before the host has read this one's tokens).

        The exit is checked every `exit_every` steps (static; the steps between run as a loop of
        fixed trip count, masked once the chunk has exited): on GPU each check is a device-to-host
        round trip. `sampler` (static): generation/sampling.py's kind for the live rows.
        `min_steps` (traced): the chunk runs at least this many steps (up to C) whatever the slots
        do: the steps carrying re-prefill rows (`RideRows`) all run."""
        B, C, S = tokens.shape[0], ec.decode_chunk, ec.max_seq_len
        slot_keys = jax.random.wrap_key_data(key_data)

        def exiting(active, i):
            return (i < C) & ((jnp.any(active) & (jnp.sum(~active) < exit_free)) | (i < min_steps))

        def step(carry):
            cache, tokens, positions, active, remaining, i, go, out = carry
            valid = active & go  # nothing runs once the chunk has exited (a fixed-count loop's tail)
            logits, cache, chosen = model_step(cache, tokens, jnp.where(valid, positions, -1), i, go)
            # The token sampled from the input at position p uses the slot's key folded with p.
            keys = jax.vmap(jax.random.fold_in)(slot_keys, positions)
            new, lp = sample_tokens(logits, keys, temperature, top_p, top_k, kind=sampler)
            positions = positions + valid
            remaining = remaining - valid
            hit_stop = jnp.any(new[:, None] == stop_ids, axis=-1)
            done = valid & (hit_stop | (remaining <= 0) | (positions >= S - 1))
            tokens = jnp.where(valid, new, tokens)
            step_out = (new, lp, valid) + ((chosen,) if record else ())
            at = jnp.where(go, i, C)  # past the chunk's end: dropped
            out = tuple(buf.at[at].set(x, mode="drop") for buf, x in zip(out, step_out))
            active, i = active & ~done, i + go
            return cache, tokens, positions, active, remaining, i, go & exiting(active, i), out

        def block(carry):
            if exit_every == 1:
                return step(carry)
            return jax.lax.fori_loop(0, exit_every, lambda _, c: step(c), carry)

        out = (jnp.zeros((C, B), jnp.int32), jnp.zeros((C, B), jnp.float32), jnp.zeros((C, B), bool))
        if record:  # [C, B, L_moe, k]
            out += (jnp.zeros((C, B, len(moe.sparse_layer_ids(cfg)), cfg.moe.num_experts_per_tok),
                              moe.record_dtype(cfg)),)
        carry = (cache, tokens, positions, active, remaining, jnp.int32(0), exiting(active, jnp.int32(0)), out)
        cache, tokens, positions, active, remaining, steps, _, out = jax.lax.while_loop(lambda c: c[6], block, carry)
        new, lp, valid, *chosen = out
        chosen = jnp.swapaxes(chosen[0], 0, 1) if record else None  # [B, C, L_moe, k]
        return cache, (new.T, lp.T, valid.T, steps, chosen, (tokens, positions, active, remaining))

    def decode(params, cache, *state, window, sampler="filter"):
        """`decode_loop` attending over cache positions [0, window) (static; every position
        reached is below it)."""
        counts["decode"] += 1
        traced[program_name("decode", window=window)] += 1

        def model_step(cache, tokens, positions, step, go):
            logits, cache, routing = forward(params, cfg, tokens[:, None], positions[:, None], cache=cache,
                                             cache_window=window, return_routing=True)
            chosen = moe.record(cfg, routing.experts[:, :, 0]) if record else None  # [B, L_moe, k]
            return logits[:, 0], cache, chosen

        return decode_loop(model_step, cache, *state, sampler=sampler, exit_every=exit_every)

    def paged_decode(params, pools, *state, window, sampler="filter"):
        """`decode_loop` over the pages: the last argument is the page tables `[B, M]`, M the pages
        of `window` positions (every position reached is below it)."""
        *state, page_tables = state
        return decode_pages(params, pools, state, page_tables, window, sampler)

    def paged_decode_ride(params, pools, *state, window, sampler="filter"):
        """`paged_decode` whose steps also re-prefill interrupted histories (EngineConfig.
        reprefill_in_decode_rows): after the page tables, `RideRows` of `[C, R, W]` tokens and
        positions and `[C, R, M]` tables (step i carries row set i) and the steps holding any
        (`ride_steps`), which the chunk runs whatever its decode rows do."""
        *state, page_tables, ride, ride_steps = state
        return decode_pages(params, pools, state, page_tables, window, sampler, ride, ride_steps)

    def decode_pages(params, pools, state, page_tables, window, sampler, ride=None, ride_steps=0):
        counts["decode"] += 1
        rows = page_tables.shape[0]  # the live slots' batch (generation/live_slots.py), else every slot
        if ride is None:
            traced[program_name("decode", window=window, **({} if rows == ec.num_slots else dict(rows=rows)))] += 1
        else:  # rows always (the full batch is its family's largest); ride rows per replica, as configured
            C, R, W = ride.tokens.shape
            traced[program_name("decode", window=window, rows=rows, ride_rows=R // data, ride_width=W)] += 1
        placement = dict(page_size=ec.page_size, impl=ec.attention_impl, platform=platform, mesh=mesh,
                         pages_per_replica=pages_per_replica(pools), quantized=pool_of(pools).quantized,
                         num_layers=L if scan else None)
        attend = make_attend(page_tables, **placement)
        attend_ride = make_ride_attend(**placement) if ride is not None else None

        def model_step(pools, tokens, positions, step, go):
            rows_now = None
            if ride is not None:
                at = jnp.minimum(step, C - 1)
                rows_now = RideRows(ride.tokens[at], jnp.where(go, ride.positions[at], -1), ride.tables[at])
            return paged_decode_step(params, cfg, tokens, positions, pools, attend, return_routing=True,
                                     ride=rows_now, attend_ride=attend_ride, replicas=data)

        return decode_loop(model_step, pools, *state, sampler=sampler, exit_every=exit_every, min_steps=ride_steps)

    def pool_of(pools):  # one layer's pool, or the stacked one
        return pools if scan else pools[0]

    def pages_per_replica(pools):  # pages of one layer on one data replica
        return pool_of(pools).num_pages // (data * (L if scan else 1))

    def insert_paged(pools, block, rows, slots, lengths, page_tables):
        if scan:
            return insert_pages_stacked(pools, block, rows, slots, lengths, page_tables, pages_per_replica(pools))
        return insert_pages(pools, block, rows, slots, lengths, page_tables)

    def paged_prefill_start(params, pools, tokens, lengths, rows, slots, key_data, positions, temperature, top_p,
                            top_k, page_tables):
        """`prefill_start` writing each started sample's prompt (positions + 1 tokens) into its pages."""
        counts["prefill"] += 1
        traced[program_name("prefill_start", rows=tokens.shape[0], len=tokens.shape[1])] += 1
        block, logits, chosen = prefill_logits(params, tokens, lengths)
        first, logprobs = sample_rows(logits, rows, key_data, positions, temperature, top_p, top_k)
        pools = insert_paged(pools, block, rows, slots, positions + 1, page_tables)
        return pools, block, logits, first, logprobs, chosen

    def paged_insert(pools, block, rows, slots, lengths, page_tables):
        R, P = block_dims(block)
        traced[program_name("insert", rows=R, len=P)] += 1
        return insert_paged(pools, block, rows, slots, lengths, page_tables)

    def paged_reprefill(params, pools, tokens, segment_ids, slot_ids, page_tables):
        counts["reprefill"] += 1
        traced[program_name("reprefill_packed", rows=tokens.shape[0])] += 1
        return prefill_into_pages(params, cfg, tokens, segment_ids, slot_ids, pools, page_tables, **attention,
                                  pages_per_replica=pages_per_replica(pools) if scan else None)

    def paged_reprefill_trie(params, pools, trie, page_tables):
        counts["reprefill"] += 1
        traced[program_name("reprefill_packed", rows=trie.input_ids.shape[0])] += 1
        return prefill_trie_into_pages(params, cfg, trie, pools, page_tables, **attention,
                                       pages_per_replica=pages_per_replica(pools) if scan else None)

    def counted(kind, fn):
        def run(*args):
            counts[kind] += 1
            return fn(*args)
        return run

    def split(params):
        traced[program_name("stack_weights" if scan else "split_weights")] += 1
        return stack_layers(params) if scan else split_layers(params)

    # Unrolled programs read weights held per layer: split once per swap of stacked weights instead
    # of once per call. Scanned ones read them stacked: split weights (a split push) are stacked once.
    split_out = param_shardings(cfg, mesh, split=not scan, weight_dtype=ec.weight_dtype) if mesh is not None else None
    paged = layout == "paged"
    # On GPU a scanned program's GEMMs read each layer's slice of the stacked weights in place.
    options = SCAN_GPU_OPTIONS if scan and (platform or jax.default_backend()) == "gpu" else None
    jit = functools.partial(jax.jit, compiler_options=options)
    return EnginePrograms(
        split=jax.jit(split, out_shardings=split_out),
        prefill_start=jit(paged_prefill_start if paged else prefill_start, donate_argnums=(1,)),
        insert=jit(counted("insert", paged_insert if paged else insert), donate_argnums=(0,)),
        first_tokens=jax.jit(counted("first_tokens", first_tokens)),
        prefill=jit(counted("prefill", prefill)),
        reprefill=jit(((paged_reprefill_trie if paged else reprefill_trie) if ec.reprefill_share_prefixes else
                       (paged_reprefill if paged else reprefill)), donate_argnums=(1,)),
        decode=jit(paged_decode if paged else decode, donate_argnums=(1,), static_argnames=("window", "sampler")),
        decode_ride=(jit(paged_decode_ride, donate_argnums=(1,), static_argnames=("window", "sampler"))
                     if paged and ec.reprefill_in_decode_rows else None),
        carry=jax.jit(counted("carry", carry_state)),
        counts=counts, traced=traced, layout=layout, scan_layers=scan)


def placed_like(params: Params, shardings: Any) -> Params:
    """`params` on `shardings` (a pytree of the same structure): leaves already laid out so are kept
    as they are (no copy), others are put there."""
    def place(x: jax.Array, s: Sharding) -> jax.Array:
        return x if x.sharding.is_equivalent_to(s, x.ndim) else jax.device_put(x, s)
    return jax.tree.map(place, params, shardings)


def weight_layout(params: Params) -> Any:
    """"dtype[shape]" of every weight in the per-layer layout, whichever layout `params` has."""
    return jax.tree.map(lambda a: f"{jnp.dtype(a.dtype)}{list(a.shape)}", jax.eval_shape(split_layers, params))


def layout_mismatch(got: Any, want: Any) -> str:
    """The first difference between two `weight_layout` trees, or "" when they are equal."""
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    if got_def != want_def:
        return f"layout {got_def} instead of {want_def}"
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        if g != w:
            return f"params{jax.tree_util.keystr(path)} is {g} instead of {w}"
    return ""
