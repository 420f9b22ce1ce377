"""EngineConfig: the engine's shapes, and the row counts of its batched calls on a data-parallel mesh.

Every compiled program of the engine is sized from here (generation/programs.py lists them): the
decode slots B and cache length S, the prompt length buckets P, the decode windows W and the row
counts R of prefill and re-prefill calls. On a generation mesh with `data` replicas every batch
dimension is a multiple of `data`, so each replica holds its share of slots and prefills its share
of rows (a dimension the mesh does not divide would be replicated, models/sharding.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from areal_jax.kernels.dispatch import IMPLS as ATTENTION_IMPLS

KV_LAYOUTS = ("auto", "paged", "dense")
KV_DTYPES = ("bfloat16", "float8_e4m3fn")
ON_SWAP = ("recompute", "keep")
WEIGHT_SWAPS = ("alongside", "evict")
WEIGHT_DTYPES = ("int8", "int4")  # models/quantize.WEIGHT_DTYPES (this module imports no model code)
FP8_KV = "float8_e4m3fn"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine shape. Compiled programs: one decode chunk per window, a prefill per (bucket, rows)."""

    num_slots: int = 8  # B; on a generation mesh a multiple of its "data" size
    max_seq_len: int = 512  # prompt + completion tokens of one sample; the KV cache length S
    # Longest prompt accepted (0: max_seq_len - 1). Admission compiles prefills only for the
    # buckets up to it; longer histories (after a swap) take the long-history path.
    max_prompt_len: int = 0
    decode_chunk: int = 8  # decode steps per jitted chunk at most: the granularity of refills and swaps
    # A chunk ends early once this many slots have finished while requests wait in the queue, so
    # freed slots are refilled without idling to the chunk's end. 0 (default): chunks run in full
    # unless every slot is done. Early refills mean more, smaller prefill calls: on the 2-core CPU
    # benchmark (16 slots, chunk 16) 2, 4 or 8 were within noise of 0 (docs/benchmarks.md).
    refill_after: int = 0
    # Cache lengths a decode chunk may attend over (one compiled chunk each): a chunk reads only
    # the smallest window that holds every active slot's sequence, not the whole cache. Default:
    # powers of two from 128 below max_seq_len, then max_seq_len.
    decode_windows: tuple[int, ...] = ()
    prefill_buckets: tuple[int, ...] = ()  # default: powers of two from 16, capped by max_seq_len
    # Most prompts prefilled together in one call (rounded up to a multiple of the data size). A
    # call's rows per data replica are the next power of four, so each prompt length bucket compiles
    # a few row counts. Large calls matter when many slots free at once (the start, a static batch):
    # 64 prompts in calls of 32 rows instead of 8 took ~30% less prefill time on the 2-core CPU
    # benchmark (bench/generation_throughput.py).
    max_prefill_batch: int = 32
    # Most tokens (rows x bucket length) one data replica prefills in one call, at least one row:
    # bounds a prefill's activations and the KV block it returns, so long prompts and long
    # re-prefilled histories go a few rows per call instead of max_prefill_batch.
    max_prefill_tokens: int = 16384
    # A prefill runs its rows in chunks of this many query tokens (a scan; attention reads the
    # earlier keys in blocks of this length with an online softmax): memory O(chunk x chunk) per
    # row and head instead of a dense [P, P] score tensor.
    prefill_chunk: int = 512
    # After a weight swap, in-flight histories up to this many tokens are re-prefilled packed
    # several to a row of this width (at most max_seq_len), written straight into their slots:
    # one call for a whole swap instead of a prefill and an insert per length bucket. Longer
    # histories are prefilled by length bucket (a wide packed row would attend over all of it).
    reprefill_pack_width: int = 512
    # Packed re-prefill rows as prefix tries (generation/reprefill_trie.py): the samples of a group
    # in flight share their prompt, which then runs once per row instead of once per sample, and
    # its keys and values go to each sample's slot. The trie's attention mask runs the jnp blocked
    # flash formula (no Pallas kernel takes it), as shared-prefix training does: attention is a
    # few percent of a re-prefill's FLOPs at these widths, the prompts shared often a third.
    # False: plain packed rows, attended by the platform's flash kernel.
    reprefill_share_prefixes: bool = True
    # Re-prefill beside decode (paged layout; with kv_layout "auto" on CPU, dense unless FP8, the
    # packed calls run instead): after an interrupting swap the in-flight samples chosen by
    # `reprefill_in_decode_tokens` keep their slots and pages but pause, and every decode step also
    # recomputes this many rows of their histories per data replica, each row
    # `reprefill_in_decode_width` consecutive tokens of one slot's history, in the same pass as the
    # step's decode rows (one read of the weights for both). A decode step at a few hundred live
    # rows leaves much of the compute idle (it waits on the weights and the cache); the rows fill
    # it instead of running as packed calls that stop generation, but a paused sample leaves the
    # decode batch until its history has ridden: on the shipped colocated configs the simulator
    # says that costs more than it saves (docs/scale.md, session 29). A slot decodes again from the
    # chunk after its last row. 0 (default): the packed re-prefill calls at the swap.
    reprefill_in_decode_rows: int = 0
    reprefill_in_decode_width: int = 128
    # The most history tokens per data replica a swap leaves to the decode steps (0: every
    # in-flight history). The longest in-flight histories ride, as many as fit; the rest are
    # re-prefilled by the packed calls at the swap, so only a few samples pause (the fewest for the
    # tokens), and the decode batch stays nearly whole while they ride.
    reprefill_in_decode_tokens: int = 0
    interruptible: bool = True
    # What an interrupting swap does with the in-flight samples' KV cache. "recompute" (AReaL's
    # semantics): re-prefill every in-flight history under the new weights. "keep" (PipelineRL's
    # in-flight update): continue on the KV the old weights wrote, no re-prefill; the tokens after
    # the swap carry the new version either way, so the recorded versions and log-probs are the
    # same kind of record (the mixed-weights KV is part of the behaviour policy under "keep").
    on_swap: str = "recompute"
    # Where the incoming weights of a push land. "alongside": next to the served ones, which keep
    # generating during the transfer (two weight copies at the swap's peak). "evict": the engine
    # first drops its weights at a chunk boundary (in-flight samples keep their slots and cache),
    # the transfer lands in their place, and generation waits for it: one copy at the peak, for a
    # model whose two copies leave no useful KV pool (a 70B on 4 H100s: 35 of 80 GiB each).
    # Colocated (MeshConfig.colocated), it drops them before each update instead, so the
    # trainer's programs run beside the KV pool only (the served weights are stale after it).
    weight_swap: str = "alongside"
    # Storage of the served weights' large matmuls (models/quantize.py). None: as pushed
    # (RLConfig.generation_dtype). "int8": weight-only int8, a symmetric absmax scale per output
    # channel, for the attention projections, MLP and expert weights (embedding, LM head, norms and
    # routers stay as pushed): about half the bytes of bf16, so a model whose bf16 copy does not fit
    # a replica's devices can, and decode reads half the weight bytes. "int4": symmetric int4 codes
    # (stored as jnp.int4, packed two a byte) with one bf16 scale per group of 128 inputs
    # (quantize.INT4_GROUP) of the same weights: about 0.26 of bf16's bytes (a 235B MoE's 470 GB
    # becomes ~124 GB, two 95 GiB v5p chips' worth), at a wider behaviour/proximal gap than int8
    # (a step of amax / 7 per group against amax / 127 per channel). Each push quantizes on the
    # training devices before the put (parallel/weight_sync.py), so it moves the codes and scales
    # and the generation devices never hold a bf16 copy; the forward
    # dequantizes each weight into its matmul. The sampled tokens and recorded behaviour log-probs
    # are then those of the quantized policy: the decoupled objective (PPOConfig.decoupled) already
    # treats the behaviour policy as distinct from the proximal one the trainer recomputes in full
    # precision, so the importance weight corrects for it. Not with LoRA pushes or
    # RLConfig.transfer_mode "delta" (both write into served weights; trainer.config.weight_dtype_conflict).
    # An engine given already quantized weights (evaluation on the run's served ones) serves them
    # as they are (int8 or int4) whatever this says.
    weight_dtype: str | None = None
    cache_dtype: str | None = None  # default: the dtype of the weights
    # Storage of the KV cache. None: cache_dtype. "bfloat16". "float8_e4m3fn": e4m3 pages with one
    # scale per layer and kv head for keys and one for values (set by the first prefill written,
    # kernels/paged_attention.py), read dequantized by every paged kernel: half the bytes of bf16
    # per token, so a pool of the same bytes holds ~2x the tokens and decode reads ~half the KV.
    # Paged layout only ("auto" then pages on CPU too). The log-probs recorded are this engine's.
    kv_dtype: str | None = None
    seed: int = 0
    # KV cache layout, "paged", "dense" or "auto" (paged on GPU and TPU, dense on CPU where paging
    # measured no faster: docs/benchmarks.md, paged vs dense). Paged: a pool of fixed-size pages
    # per layer, each slot holding the pages its sequence has grown into (page tables on the host),
    # decode attention reading only live pages, admission by free pages and preemption (recompute
    # later) when the pool runs dry. Dense: one [num_slots, max_seq_len] buffer per layer, decode
    # attending over the smallest `decode_windows` entry holding the longest sequence.
    kv_layout: str = "auto"
    page_size: int = 16  # tokens per page (paged layout)
    # Pool size of the paged layout, per data replica: in pages, or in bytes (keys and values of
    # every layer over the replica's tensor shards; divided by the bytes of one page, rounded
    # down). Set at most one; neither: as many pages as a dense cache of num_slots x max_seq_len.
    # At least one max_seq_len sequence must fit, so the longest sample can always finish. With a
    # pool smaller than the dense cache, num_slots may exceed what the pool could hold at full
    # length: many short sequences in flight.
    kv_pool_pages: int = 0  # pool pages per data replica (0: unset)
    kv_pool_bytes: int = 0  # pool bytes per data replica, all layers' keys and values (0: unset)
    # Attention kernels of the engine: paged decode, prefill chunks and packed re-prefill. "pallas"
    # (the platform's Pallas kernels, areal_jax/kernels/), "reference" (jnp: a gather of each slot's
    # pages, `chunk_attention`, the blocked formula), or "auto" (pallas where one is registered for
    # the platform, else reference).
    attention_impl: str = "auto"
    # Paged layout: a decode chunk runs over the live slots only. Its batch per data replica is the
    # most live slots of a replica rounded up to a power of two, at least this many, at most the
    # replica's slots; the live slots' page tables are gathered into it (no KV moves). One compiled
    # chunk per (window, batch): num_slots / data or more turns it off. At 240 slots and ~17 live a
    # full-batch step computes ~14x the rows it needs (the weights' FLOPs per row).
    decode_min_rows: int = 16
    # Paged layout: a group's samples hold its prompt's full pages together (reference-counted;
    # each its own copy of the partial last page), so the pool and admission count them once
    # (generation/pages.py). Off: every sample its own copy, as the dense cache holds.
    share_prompt_pages: bool = True
    # Overlapped host scheduling: the next decode chunk is dispatched (from the last one's final
    # state, left on the device) before the last one's tokens are read back, so the device runs
    # while the host folds tokens, finishes and refills slots. Slots the last chunk freed are
    # refilled one chunk later; aborts, weight swaps and a pool too dry for both chunks' pages
    # first read the chunk in flight (tokens, log-probs and versions are those of overlap off).
    overlap: bool = False
    # Decode steps between checks of a chunk's exit (every slot done, or refill_after slots free):
    # the steps between run as a fixed-count loop, masked after the exit. On GPU every check is a
    # device-to-host round trip. 0: auto (8 or the chunk on GPU, 1 elsewhere, where a check is
    # free).
    decode_exit_every: int = 0
    # Paged layout: hold the weights stacked (`[L, ...]`, the trainer's layout) and every layer's
    # pages in one pool, and run the layers of every program (decode step, prefills, re-prefill,
    # insert) as a scan: one compiled layer body whatever the depth, so a 94-layer model's programs
    # compile in about the time of a few layers' (`areal-jax plan` of the 235B and 70B configs).
    # The same arithmetic as the unrolled programs. Each layer's weights are then a slice of the
    # stacked arrays: on TPU XLA reads it inside the matmul; on GPU the engine's programs compile
    # with cuBLAS GEMMs and XLA's dynamic-slice fusion so it is not copied first. The dense layout
    # (CPU's default) always unrolls.
    scan_layers: bool = False

    def __post_init__(self):
        for name in ("num_slots", "max_seq_len", "decode_chunk", "max_prefill_batch", "reprefill_pack_width",
                     "max_prefill_tokens", "prefill_chunk", "decode_min_rows"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("reprefill_in_decode_rows", "reprefill_in_decode_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"EngineConfig.{name} must be an int >= 0, got {v!r}")
        if not isinstance(self.reprefill_in_decode_width, int) or self.reprefill_in_decode_width < 1:
            raise ValueError(f"EngineConfig.reprefill_in_decode_width must be an int >= 1, "
                             f"got {self.reprefill_in_decode_width!r}")
        if self.reprefill_in_decode_rows and self.kv_layout == "dense":
            raise ValueError("EngineConfig.reprefill_in_decode_rows needs the paged KV cache (its rows attend over "
                             "their slots' pages): kv_layout 'paged' or 'auto'")
        if not isinstance(self.reprefill_share_prefixes, bool):
            raise ValueError(f"EngineConfig.reprefill_share_prefixes must be a bool, got {self.reprefill_share_prefixes!r}")
        if not isinstance(self.decode_exit_every, int) or self.decode_exit_every < 0:
            raise ValueError(f"EngineConfig.decode_exit_every must be an int >= 0 (0: auto), "
                             f"got {self.decode_exit_every!r}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"EngineConfig.scan_layers must be a bool, got {self.scan_layers!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"EngineConfig.overlap must be a bool, got {self.overlap!r}")
        if not isinstance(self.refill_after, int) or self.refill_after < 0:
            raise ValueError(f"EngineConfig.refill_after must be an int >= 0, got {self.refill_after!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"EngineConfig.kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.on_swap not in ON_SWAP:
            raise ValueError(f"EngineConfig.on_swap must be one of {ON_SWAP}, got {self.on_swap!r}")
        if self.weight_swap not in WEIGHT_SWAPS:
            raise ValueError(f"EngineConfig.weight_swap must be one of {WEIGHT_SWAPS}, got {self.weight_swap!r}")
        if self.weight_dtype is not None and self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"EngineConfig.weight_dtype must be None (as pushed) or one of {WEIGHT_DTYPES}, "
                             f"got {self.weight_dtype!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"EngineConfig.kv_dtype must be None (cache_dtype) or one of {KV_DTYPES}, "
                             f"got {self.kv_dtype!r}")
        if self.kv_dtype is not None and self.cache_dtype is not None and self.kv_dtype != FP8_KV:
            raise ValueError(f"EngineConfig.kv_dtype = {self.kv_dtype!r} and cache_dtype = {self.cache_dtype!r} "
                             "both set the cache's dtype: set one")
        if self.kv_dtype == FP8_KV and self.kv_layout == "dense":
            raise ValueError("EngineConfig.kv_dtype = 'float8_e4m3fn' needs the paged KV cache (its scales live "
                             "in the page pools): kv_layout 'paged' or 'auto'")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"EngineConfig.attention_impl must be one of {ATTENTION_IMPLS}, "
                             f"got {self.attention_impl!r}")
        for name in ("page_size",):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("kv_pool_pages", "kv_pool_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"EngineConfig.{name} must be an int >= 0 (0: unset), got {v!r}")
        if self.kv_pool_pages and self.kv_pool_bytes:
            raise ValueError("EngineConfig.kv_pool_pages and kv_pool_bytes are both set: size the pool one way")
        if self.kv_pool_pages and self.kv_pool_pages < self.pages_per_sequence:
            raise ValueError(f"EngineConfig.kv_pool_pages = {self.kv_pool_pages} holds less than one sequence of "
                             f"max_seq_len = {self.max_seq_len} ({self.pages_per_sequence} pages of {self.page_size})")
        if self.max_seq_len < 2:
            raise ValueError("EngineConfig.max_seq_len must be >= 2 (one prompt token and one generated)")
        if not isinstance(self.max_prompt_len, int) or not 0 <= self.max_prompt_len < self.max_seq_len:
            raise ValueError(f"EngineConfig.max_prompt_len must be an int in [0, max_seq_len = {self.max_seq_len}) "
                             f"(0: max_seq_len - 1), got {self.max_prompt_len!r}")
        buckets = tuple(sorted(set(self.prefill_buckets))) or _default_buckets(self.max_seq_len)
        if buckets[-1] < self.max_seq_len - 1 or any(b < 1 for b in buckets):
            raise ValueError(f"prefill_buckets {buckets} must be >= 1 and cover max_seq_len - 1 = "
                             f"{self.max_seq_len - 1}")
        object.__setattr__(self, "prefill_buckets", tuple(b for b in buckets if b < self.max_seq_len)
                           + ((self.max_seq_len,) if buckets[-1] >= self.max_seq_len else ()))
        windows = tuple(sorted(set(self.decode_windows))) or _default_buckets(self.max_seq_len, start=128)
        if any(not isinstance(w, int) or not 0 < w <= self.max_seq_len for w in windows):
            raise ValueError(f"decode_windows {windows} must be ints in [1, max_seq_len = {self.max_seq_len}]")
        object.__setattr__(self, "decode_windows", tuple(w for w in windows if w < self.max_seq_len)
                           + (self.max_seq_len,))

    def serves_stacked(self, platform: str) -> bool:
        """Whether the engine holds its weights stacked on `platform` (scan_layers over the paged
        layout), the layout a push should then deliver."""
        return self.scan_layers and self.layout(platform) == "paged"

    def layout(self, platform: str) -> str:
        """"paged" or "dense" for a platform ("cpu", "gpu", "tpu"): `kv_layout` with "auto" resolved."""
        if self.kv_layout != "auto":
            return self.kv_layout
        return "dense" if platform == "cpu" and self.kv_dtype != FP8_KV else "paged"

    def exit_every(self, platform: str) -> int:
        """Decode steps between exit checks on `platform`: `decode_exit_every` with 0 resolved."""
        if self.decode_exit_every:
            return min(self.decode_exit_every, self.decode_chunk)
        return min(8, self.decode_chunk) if platform == "gpu" else 1

    def block_dtype(self, weights_dtype) -> str:
        """Dtype of prefill blocks and of a dense cache: kv_dtype unless FP8, else cache_dtype, else
        the weights'."""
        if self.kv_dtype is not None and self.kv_dtype != FP8_KV:
            return self.kv_dtype
        return self.cache_dtype or np.dtype(weights_dtype).name

    def storage_dtype(self, weights_dtype) -> str:
        """Dtype the KV cache stores (a paged pool's pages): kv_dtype, else `block_dtype`."""
        return self.kv_dtype or self.block_dtype(weights_dtype)

    def kv_itemsize(self, weights_dtype) -> int:
        """Bytes of one stored key or value element (1 for FP8)."""
        return np.dtype(self.storage_dtype(weights_dtype)).itemsize

    def kv_scale_bytes(self, num_layers: int, num_kv_heads: int, weights_dtype) -> int:
        """Bytes an FP8 pool holds besides its pages: a key and a value scale (fp32) per layer and
        kv head; 0 otherwise."""
        return 2 * 4 * num_layers * num_kv_heads if self.storage_dtype(weights_dtype) == FP8_KV else 0

    @property
    def pages_per_sequence(self) -> int:
        """Pages one max_seq_len sequence holds: the width of a slot's page table."""
        return -(-self.max_seq_len // self.page_size)

    def pool_pages(self, page_bytes: int, data: int = 1, fixed_bytes: int = 0) -> int:
        """Pages of the pool per data replica (of `data`), given the bytes of one page (all layers,
        keys and values, all tensor shards of the replica together) and the pool's bytes besides
        its pages (`kv_scale_bytes`), which kv_pool_bytes also holds."""
        if self.kv_pool_pages:
            return self.kv_pool_pages
        if self.kv_pool_bytes:
            pages = max(0, self.kv_pool_bytes - fixed_bytes) // page_bytes
            if pages < self.pages_per_sequence:
                raise ValueError(f"EngineConfig.kv_pool_bytes = {self.kv_pool_bytes} holds {pages} pages of "
                                 f"{page_bytes} bytes, less than one sequence of max_seq_len = {self.max_seq_len} "
                                 f"({self.pages_per_sequence} pages)")
            return pages
        return -(-self.num_slots // data) * self.pages_per_sequence

    def chunk_tokens(self, position: int, remaining: int) -> int:
        """Positions [0, tokens) a sample whose next input is at `position`, with `remaining` tokens
        left to generate, may have written by the end of the next decode chunk (at least `position`)."""
        return max(position, min(position + min(self.decode_chunk, remaining), self.max_seq_len - 1))

    def decode_pages(self, window: int) -> int:
        """Page-table width M of a paged decode chunk attending over `window` positions."""
        return -(-window // self.page_size)

    def decode_rows(self, live: int, data: int = 1) -> int:
        """Decode batch rows per data replica when its busiest replica has `live` live slots:
        the next power of two of `live`, at least `decode_min_rows`, at most num_slots / data."""
        per_replica = self.num_slots // data
        if not 0 <= live <= per_replica:
            raise ValueError(f"a replica holds 0 to {per_replica} live slots, got {live}")
        return _round_up_pow(max(live, self.decode_min_rows, 1), 2, per_replica)

    def decode_row_counts(self, data: int = 1) -> tuple[int, ...]:
        """Every decode batch per replica `decode_rows` gives (the last: all of a replica's slots)."""
        return tuple(sorted({self.decode_rows(n, data) for n in range(self.num_slots // data + 1)}))

    def bucket(self, length: int) -> int:
        return next(b for b in self.prefill_buckets if b >= length)

    def decode_window(self, needed: int) -> int:
        """Cache positions a decode chunk attends over when its sequences need `needed` of them."""
        return next((w for w in self.decode_windows if w >= needed), self.max_seq_len)

    @property
    def prompt_limit(self) -> int:
        """Longest prompt `submit` accepts."""
        return self.max_prompt_len or self.max_seq_len - 1

    def admission_buckets(self) -> tuple[int, ...]:
        """Buckets of prompts (what admission prefills)."""
        last = self.bucket(self.prompt_limit)
        return tuple(b for b in self.prefill_buckets if b <= last)

    @property
    def pack_width(self) -> int:
        """Row width of packed re-prefill calls."""
        return min(self.reprefill_pack_width, self.max_seq_len)

    # ---- row counts: R = data x (rows per replica) ----------------------------------------------

    def _rows_per_replica_max(self, length: int, data: int) -> int:
        # No call holds more prompts than there are slots (num_slots is a multiple of data).
        return max(1, min(-(-self.max_prefill_batch // data), -(-self.num_slots // data),
                          self.max_prefill_tokens // length))

    def max_prefill_prompts(self, length: int, data: int = 1) -> int:
        """Most prompts (or histories) of length bucket `bucket(length)` in one prefill call."""
        return data * self._rows_per_replica_max(self.bucket(length), data)

    def prefill_rows(self, n: int, length: int, data: int = 1) -> int:
        """Rows R of a prefill call for n prompts of bucket `bucket(length)`: per data replica the
        next power of four (1, 4, 16, ...) of its share, at most the call's maximum. Padding rows
        cost little next to the programs finer steps would compile."""
        if not 1 <= n <= self.max_prefill_prompts(length, data):
            raise ValueError(f"a prefill call of length {length} takes 1 to "
                             f"{self.max_prefill_prompts(length, data)} prompts, got {n}")
        return data * _round_up_pow(-(-n // data), 4, self._rows_per_replica_max(self.bucket(length), data))

    def prefill_row_counts(self, length: int, data: int = 1) -> tuple[int, ...]:
        """Every row count `prefill_rows` gives at bucket `bucket(length)` for at most num_slots prompts."""
        most = min(self.max_prefill_prompts(length, data), self.num_slots)
        return tuple(sorted({self.prefill_rows(n, length, data) for n in range(1, most + 1)}))

    @property
    def prefill_batch_buckets(self) -> tuple[int, ...]:
        """Row counts of calls of the shortest bucket on one device (what a benchmark warms up)."""
        return self.prefill_row_counts(self.prefill_buckets[0])

    def max_pack_rows(self, data: int = 1) -> int:
        """Most packed rows in one re-prefill call."""
        return data * self._rows_per_replica_max(self.pack_width, data)

    def pack_rows(self, n: int, data: int = 1) -> int:
        """Rows of a packed re-prefill call holding n packed rows: per data replica the next power of
        two of its share (packed rows are full, so finer steps than prefill's pay)."""
        if not 1 <= n <= self.max_pack_rows(data):
            raise ValueError(f"a packed call takes 1 to {self.max_pack_rows(data)} rows, got {n}")
        return data * _round_up_pow(-(-n // data), 2, self._rows_per_replica_max(self.pack_width, data))

    def pack_row_counts(self, data: int = 1) -> tuple[int, ...]:
        """Every row count `pack_rows` gives for at most num_slots histories (one row each at most)."""
        most = min(self.max_pack_rows(data), self.num_slots)
        return tuple(sorted({self.pack_rows(n, data) for n in range(1, most + 1)}))

    def long_history_buckets(self) -> tuple[int, ...]:
        """Buckets of re-prefilled histories too long for a packed row: (pack_width, max_seq_len - 1]."""
        if self.pack_width >= self.max_seq_len - 1:
            return ()
        first = self.bucket(self.pack_width + 1)
        return tuple(b for b in self.prefill_buckets if b >= first)


def round_slots(slots: int, data: int) -> int:
    """`slots` rounded up to a multiple of the `data` replicas: the one rule every engine's slots
    follow on a data-parallel mesh. Each replica gets the same share, ceil(slots / data), which is
    never more than `slots` would hold on one device; a count already a multiple (an RL engine's
    EngineConfig.num_slots, which `programs.check_mesh` requires) stays, so a smaller request
    rounded up never exceeds it."""
    return -(-slots // data) * data


def prompts_engine_config(prompts: int, longest_prompt: int, max_new_tokens: int, *, slots: int, data: int = 1,
                          **fields) -> EngineConfig:
    """The engine of a fixed set of `prompts` generations (held-out evaluation, one-off sampling):
    min(`slots`, prompts) slots rounded to the `data` replicas (`round_slots`), and room for the
    longest prompt, `max_new_tokens` and the stop token, rounded up to 16 (fewer distinct programs).
    The run's evaluation engine and `areal-jax plan`'s account of it are both this config."""
    return EngineConfig(num_slots=round_slots(min(slots, prompts), data),
                        max_seq_len=-(-(longest_prompt + max_new_tokens + 1) // 16) * 16, **fields)


def _round_up_pow(n: int, base: int, cap: int) -> int:
    """The smallest power of `base` >= n, at most `cap`."""
    out = 1
    while out < n:
        out *= base
    return min(out, cap)


def _default_buckets(max_seq_len: int, start: int = 16) -> tuple[int, ...]:
    out, b = [], start
    while b < max_seq_len:
        out.append(b)
        b *= 2
    return tuple(out) + (max_seq_len,)
