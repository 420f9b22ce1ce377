"""The generation engine's programs described ahead of time, for the planner.

`engine_program_specs` describes every program `build_programs` (generation/programs.py) jits, at
a config's shapes, as `aot.ProgramSpec`s: abstract, sharded arguments, nothing allocated, so the
planner compiles and measures them without hardware. Layouts as generation/programs.py says.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.aot import ProgramSpec, Role
from areal_jax.generation.config import EngineConfig
from areal_jax.generation.paged import page_bytes, pool_scale_bytes, pool_structs
from areal_jax.generation.programs import (CACHE_AXES, LOGITS_AXES, build_programs, cache_sharding, check_mesh,
                                           mesh_sizes, param_structs, program_name)
from areal_jax.generation.reprefill_trie import TRIE_WRITES_PER_NODE
from areal_jax.generation.sampling import MAX_STOP_IDS
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoding import RideRows, TrieRows
from areal_jax.models.sharding import GENERATION_RULES, activation_rules, sharding_for
from areal_jax.models.transformer import KVCache

__all__ = ["engine_program_specs"]


_CACHE_FIELDS = ("EngineConfig.num_slots", "EngineConfig.max_seq_len", "EngineConfig.cache_dtype",
                 "EngineConfig.kv_dtype",
                 "MeshConfig.generation_tensor", "MeshConfig.generation_expert")
_PAGED_FIELDS = ("EngineConfig.kv_layout", "EngineConfig.page_size", "EngineConfig.kv_pool_pages",
                 "EngineConfig.kv_pool_bytes", "EngineConfig.attention_impl", "EngineConfig.scan_layers")
_PREFILL_FIELDS = ("EngineConfig.prefill_buckets", "EngineConfig.max_prompt_len", "EngineConfig.max_prefill_batch",
                   "EngineConfig.max_prefill_tokens", "EngineConfig.prefill_chunk")

_RIDE_FIELDS = ("EngineConfig.decode_min_rows", "EngineConfig.reprefill_in_decode_rows",
                "EngineConfig.reprefill_in_decode_width")


def engine_program_specs(model_cfg: ModelConfig, engine_cfg: EngineConfig, *, mesh: Mesh, param_dtype,
                         cache_dtype=None, role: Role = "generation", platform: str | None = None
                         ) -> list[ProgramSpec]:
    """Every program the engine can run at the config's shapes on the ("data", "expert", "tensor") `mesh`.

    Names (prefixed with `role`): prefill_start[rows=R,len=P] for every prompt bucket (up to
    max_prompt_len) and row count; first_tokens[rows=R] and insert[rows=R,len=P] for the later
    samples of a group from its kept block; reprefill_packed[rows=R] for every packed row count;
    prefill[rows=R,len=P] + insert for histories longer than a packed row; decode[window=W] for
    every window (paged: also decode[window=max,rows=R] for every live-slot batch below num_slots;
    with reprefill_in_decode_rows, decode[window=max,rows=R,ride_rows=..,ride_width=..] for every batch);
    split_weights (a swap of stacked weights; split weights install without a program; with
    scan_layers stack_weights, the other way round). Resident:
    the weights and cache where they are not arguments; with role "generation" one incoming weight
    copy (a transfer can land while any program runs; none under weight_swap "evict"); during decode the block a partly started
    group keeps (the largest admission block).

    `platform` is the target (default: jax's default backend): it resolves `kv_layout` "auto" and
    the paged attention kernel. Paged: the cache is L pools of `data x pool_pages` pages (pages
    over "data"), each program takes the page tables `[B, M]` last (decode: M = the window's pages).
    """
    check_mesh(model_cfg, engine_cfg, mesh)
    ec, cfg = engine_cfg, model_cfg
    data, _ = mesh_sizes(mesh)
    cache_dtype = jnp.dtype(cache_dtype or ec.block_dtype(param_dtype))
    programs = build_programs(cfg, ec, cache_dtype, mesh=mesh, platform=platform)
    B, S, K, H, V = ec.num_slots, ec.max_seq_len, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
    paged = programs.layout == "paged"
    if paged:
        store = jnp.dtype(ec.storage_dtype(cache_dtype))  # the pool's (FP8 with kv_dtype float8_e4m3fn)
        pages = data * ec.pool_pages(page_bytes(cfg, ec.page_size, store), data, pool_scale_bytes(cfg, store))
        cache = pool_structs(cfg, pages, ec.page_size, store, mesh, impl=ec.attention_impl, platform=platform,
                             stacked=programs.scan_layers)
        cache_fields = _CACHE_FIELDS + _PAGED_FIELDS
    else:
        layer = jax.ShapeDtypeStruct((B, K, S, H), cache_dtype, sharding=cache_sharding(cfg, ec, mesh))
        cache = KVCache((layer,) * cfg.num_layers, (layer,) * cfg.num_layers)
        cache_fields = _CACHE_FIELDS
    scan = programs.scan_layers
    params = param_structs(cfg, mesh, param_dtype, split=not scan, weight_dtype=ec.weight_dtype)
    # A push lands beside the served weights, unless the engine evicts them first (weight_swap).
    incoming = (params,) if role == "generation" and ec.weight_swap == "alongside" else ()
    replicated = NamedSharding(mesh, PartitionSpec())

    def host(shape, dtype):  # per-call inputs from the host, replicated as the engine puts them
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    def block(R, P):  # a prefill's KV block, rows over "data" as its activations
        shard = sharding_for(CACHE_AXES, GENERATION_RULES, mesh, (R, K, P, H))
        if scan:  # stacked [L, R, K, P, H]
            shard = NamedSharding(mesh, PartitionSpec(None, *shard.spec))
            one = jax.ShapeDtypeStruct((cfg.num_layers, R, K, P, H), cache_dtype, sharding=shard)
            return KVCache(one, one)
        one = jax.ShapeDtypeStruct((R, K, P, H), cache_dtype, sharding=shard)
        return KVCache((one,) * cfg.num_layers, (one,) * cfg.num_layers)

    def logits(R):  # a prefill's last-position logits, laid out as prefill_start returns them
        return jax.ShapeDtypeStruct((R, V), jnp.float32, sharding=sharding_for(LOGITS_AXES, GENERATION_RULES, mesh,
                                                                               (R, V)))

    starts = (host((B,), jnp.int32), host((B,), jnp.int32), host((B, 2), jnp.uint32), host((B,), jnp.int32),
              host((B,), jnp.float32), host((B,), jnp.float32), host((B,), jnp.int32))  # rows .. top_k
    sampling = starts[:1] + starts[2:]  # first_tokens: rows, keys, positions, temperature, top_p, top_k
    # Paged: the page tables follow every cache-writing program's arguments (an insert's row
    # lengths before them).
    tables = (host((B, ec.pages_per_sequence), jnp.int32),) if paged else ()
    insert_extra = (host((B,), jnp.int32),) + tables if paged else ()
    context = lambda: activation_rules(GENERATION_RULES, mesh)  # noqa: E731
    specs: list[ProgramSpec] = []
    seen: set[str] = set()

    def add(kind, dims, fn, args, resident, fields, kwargs=None):
        name = f"{role}/{program_name(kind, **dims)}"
        if name not in seen:
            seen.add(name)
            specs.append(ProgramSpec(name, role, fn, args=args, kwargs=kwargs or {}, resident=resident,
                                     context=context, fields=fields))

    admission = [(R, P) for P in ec.admission_buckets() for R in ec.prefill_row_counts(P, data)]
    for R, P in admission:
        tokens = (host((R, P), jnp.int32), host((R,), jnp.int32))
        add("prefill_start", dict(rows=R, len=P), programs.prefill_start,
            (params, cache, *tokens, *starts, *tables), incoming, _PREFILL_FIELDS + cache_fields)
        add("insert", dict(rows=R, len=P), programs.insert, (cache, block(R, P), *starts[:2], *insert_extra),
            (params, logits(R)) + incoming, _PREFILL_FIELDS + cache_fields)
    for R in sorted({R for R, _ in admission}):  # the kept block of the longest bucket stays meanwhile
        P = max(P for r, P in admission if r == R)
        add("first_tokens", dict(rows=R), programs.first_tokens, (logits(R), *sampling),
            (params, cache, block(R, P)) + incoming, _PREFILL_FIELDS)
    for P in ec.long_history_buckets():
        for R in ec.prefill_row_counts(P, data):
            tokens = (host((R, P), jnp.int32), host((R,), jnp.int32))
            fields = _PREFILL_FIELDS + cache_fields + ("EngineConfig.reprefill_pack_width",)
            add("prefill", dict(rows=R, len=P), programs.prefill, (params, *tokens), (cache,) + incoming, fields)
            add("insert", dict(rows=R, len=P), programs.insert, (cache, block(R, P), *starts[:2], *insert_extra),
                (params,) + incoming, fields)
    W = ec.pack_width
    for R in ec.pack_row_counts(data):
        if ec.reprefill_share_prefixes:  # one TrieRows: nodes [R, W], write entries [R, E]
            E = TRIE_WRITES_PER_NODE * W
            packed = (TrieRows(*(host((R, W), jnp.int32) for _ in range(4)), *(host((R, E), jnp.int32) for _ in range(3))),)
        else:
            packed = tuple(host((R, W), jnp.int32) for _ in range(3))
        add("reprefill_packed", dict(rows=R), programs.reprefill, (params, cache, *packed, *tables), incoming,
            cache_fields + ("EngineConfig.reprefill_pack_width", "EngineConfig.max_prefill_batch",
                            "EngineConfig.max_prefill_tokens", "EngineConfig.reprefill_share_prefixes"))
    # A group that found too few free slots keeps its prefill block (and logits) while it waits.
    R, P = max(admission, key=lambda rp: rp[0] * rp[1])
    kept = (block(R, P), logits(R))
    slot_state = (host((B,), jnp.int32), host((B,), jnp.int32), host((B,), bool), host((B,), jnp.int32),
                  host((B,), jnp.float32), host((B,), jnp.float32), host((B,), jnp.int32),
                  host((B, MAX_STOP_IDS), jnp.int32), host((B, 2), jnp.uint32), host((), jnp.int32))
    decode_fields = cache_fields + ("EngineConfig.decode_windows", "EngineConfig.decode_chunk") + _PREFILL_FIELDS
    for window in ec.decode_windows:
        window_tables = (host((B, ec.decode_pages(window)), jnp.int32),) if paged else ()
        add("decode", dict(window=window), programs.decode, (params, cache, *slot_state, *window_tables),
            kept + incoming, decode_fields, kwargs=dict(window=window))
    if paged:  # the live slots' batches (generation/live_slots.py), at the widest window (a bound)
        W = ec.decode_windows[-1]
        for b in ec.decode_row_counts(data)[:-1]:
            rows = tuple(host((data * b, *a.shape[1:]), a.dtype) for a in slot_state[:-1]) + slot_state[-1:]
            add("decode", dict(window=W, rows=data * b), programs.decode,
                (params, cache, *rows, host((data * b, ec.decode_pages(W)), jnp.int32)), kept + incoming,
                decode_fields + ("EngineConfig.decode_min_rows",), kwargs=dict(window=W))
    if programs.decode_ride is not None:  # decode carrying re-prefill rows, every batch at the widest window
        W, C, R = ec.decode_windows[-1], ec.decode_chunk, data * ec.reprefill_in_decode_rows
        M = ec.decode_pages(W)
        ride = (RideRows(host((C, R, ec.reprefill_in_decode_width), jnp.int32),
                         host((C, R, ec.reprefill_in_decode_width), jnp.int32), host((C, R, M), jnp.int32)),
                host((), jnp.int32))
        ride_dims = dict(ride_rows=ec.reprefill_in_decode_rows, ride_width=ec.reprefill_in_decode_width)
        for b in ec.decode_row_counts(data):
            rows = tuple(host((data * b, *a.shape[1:]), a.dtype) for a in slot_state[:-1]) + slot_state[-1:]
            dims = dict(window=W, rows=data * b, **ride_dims)  # rows always: the full batch is the family's largest
            add("decode", dims, programs.decode_ride, (params, cache, *rows, host((data * b, M), jnp.int32), *ride),
                kept + incoming, decode_fields + _RIDE_FIELDS, kwargs=dict(window=W))
    # The change of layout at a swap: stacked -> split, or (scanned) a split push -> stacked.
    add("stack_weights" if scan else "split_weights", {}, programs.split,
        (param_structs(cfg, mesh, param_dtype, split=scan, weight_dtype=ec.weight_dtype if scan else None),),
        (cache,) + incoming, cache_fields)
    return specs
