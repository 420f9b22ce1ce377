"""A hand estimate of each program's peak bytes per device, printed beside the compiler's figure.

Arguments and residents are counted exactly from the spec's shapes and shardings; what the
estimate adds is a model of the temporaries each kind of program needs, from the model's
dimensions (letters of models/config.py):

- decode: per step, fp32 logits `[B, V]` and sampling's copies of them, one layer's attention
  scores `[B, N, W]` (fp32, twice: scores and probabilities) and MLP activations `[B, F]`. On a
  paged pool the reference also gathers one layer's pages of every slot (`[K, B, W, H]`, keys and
  values); a paged kernel keeps neither scores nor gather.
- prefill: the new KV block `[R, K, P, H]` x L (an output), one query chunk's activations
  `[R, C, 2D + 3F]` (weights' dtype) and scores `[R, N, C, C]` (fp32). Packed re-prefill: one
  packed row's activations and one causal query block's scores.
- grad: with remat "full" every layer's input `[R, T, D]` is saved (compute dtype), the gradient
  of the trained weights (fp32; with LoRA the adapters only) and one layer of weights gathered
  in the compute dtype; then the larger of two phases that never overlap: the backward of a
  layer (its recomputed activations `[R, T, 4D + 3F]` and their gradients in the compute dtype,
  and its attention probabilities, the causal half of `[R, N, T, T]` fp32, unless flash), or
  the backward of the head (one logit chunk `[R, Tc, V]` fp32 and its gradient, beside the final
  hidden states). Without remat, every layer's activations are saved. For a mixture of experts
  also one sparse layer's expert gradient (fp32) and the next layer's experts, gathered
  (`layer_expert_elements`).
- logprobs: the larger of one logit chunk and a quarter of a layer's activations, beside the
  final hidden states and two layers of weights gathered (one in use, the next arriving):
  nothing is kept for a backward.
- update: nothing beyond its arguments (weights and moments are donated and updated in place).
- transfer: the group being moved, in the generation dtype, twice (cast and gathered).
- a learned reward's forward ("score": a reward model, "choices": a logprob judge, on its own
  model's sizes, `EstimateContext.learned`): one layer's activations `[R, T, 2D + 3F]`, its scores
  unless flash, the final hidden states (fp32) and the last position's logits (choices). A regex
  judge's engine programs are estimated as the policy's engine's, on the judge's sizes.
Everything per device: sharded dimensions divided by their mesh axis. For a mixture-of-experts
model the MLP terms are those of its widest layer (`mlp_acts`): a sparse layer's k routed experts
and shared expert in place of 3F, plus the token buffers that place tokens with their experts
(`expert_buffers`: dispatch and combine, tokens x k x D, over the expert group's tokens when
training rows shard over the expert axis) and the fp32 router probabilities `[E]`; the expert
weights (all experts resident, split over the expert axis) and the router are arguments, counted
exactly. FLOPs count the k active experts, the shared expert and the router (`mlp_flops`).

The test suite holds the estimate within 25% of XLA's figure on small shapes; at real shapes the
difference says how much the compiler's scheduling and fusion save or cost.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from areal_jax.aot import ProgramSpec, bytes_per_device
from areal_jax.models.config import ModelConfig
from areal_jax.ppo.logprobs import chunk_layout


@dataclasses.dataclass(frozen=True)
class EstimateContext:
    """Sizes the estimate needs beyond the spec: the model, mesh axis sizes, dtypes and knobs."""

    model: ModelConfig
    fsdp: int = 1  # train mesh
    train_tensor: int = 1
    generation_tensor: int = 1
    train_expert: int = 1  # rows shard over fsdp x expert; a MoE layer gathers its expert group's rows
    generation_expert: int = 1  # rows whole per replica: nothing gathered
    compute_bytes: int = 2  # bf16 compute (4: fp32)
    cache_bytes: int = 2
    remat: str = "full"
    logit_chunk_tokens: int = 4096
    decode_chunk: int = 1
    prefill_chunk: int = 512  # EngineConfig.prefill_chunk: queries per step of a chunked prefill
    # The learned rewards' models (reward/programs.py), by label ("rm", "judge"): a "reward"
    # program is estimated on its own model's sizes (`for_spec`).
    learned: tuple[tuple[str, "EstimateContext"], ...] = ()

    def for_spec(self, spec: ProgramSpec) -> "EstimateContext":
        """The sizes of the model `spec` runs: a learned reward's for its programs, else these."""
        if spec.role != "reward":
            return self
        label = spec.name.split("/")[1]
        return next(c for name, c in self.learned if name == label)


def _dims(name: str) -> dict[str, int]:
    inside = name[name.index("[") + 1:-1] if "[" in name else ""
    return {k: int(v) for k, v in (p.split("=") for p in inside.split(",") if "=" in p)}


def _kind(name: str) -> str:
    """"train/grad[...]" -> "grad"; a learned reward's "reward/judge/decode[...]" -> "decode"."""
    base = name.split("[")[0]
    return base.rsplit("/", 1)[-1] if base.startswith("reward/") else base.split("/", 1)[-1]


# Kernels (plan/measure.py's names) that keep no `[T, T]` or `[B, N, W]` scores: flash attention
# keeps a log-sum-exp per query, the paged decode kernels one block of scores on chip, the prefill
# kernels one block of a chunk's scores.
FLASH_KERNELS = ("splash", "pallas_triton_flash", "cudnn", "pallas_triton_prefill", "pallas_mosaic_prefill")
PAGED_KERNELS = ("ragged_paged", "pallas_triton_paged")


def expert_buffers(m: ModelConfig, group: int = 1) -> int:
    """Elements per (local) token of a sparse layer's token buffers, the all-to-all's equivalent
    (models/moe.py `_experts`): dispatch, the k assignments' inputs sorted by expert `[k, D]`, and
    combine, their outputs and its unsorted copy `[2k, D]`, for every token of the expert group
    (`group` = the expert axis when rows shard over it, as in training; 1 in generation); with
    group > 1 also the gathered rows and the sums reduce-scattered back (`[2, D]` per group token)."""
    if m.moe is None:
        return 0
    k, D = m.moe.num_experts_per_tok, m.hidden_size
    return group * (3 * k * D + (2 * D if group > 1 else 0))


def mlp_acts(m: ModelConfig, t: int = 1, group: int = 1) -> int:
    """Elements per token of one layer's MLP activations (tensor size `t`): 3F for a dense MLP;
    for the widest layer of a MoE model the k routed experts' `[3 Fe]` over the expert group's
    tokens, the shared expert's `[3 Fs]`, the fp32 router probabilities `[E]` and `expert_buffers`."""
    dense = 3 * m.intermediate_size // t if not all(m.sparse_layers) else 0
    if m.moe is None:
        return dense
    e = m.moe
    sparse = (group * 3 * e.num_experts_per_tok * e.moe_intermediate_size // t
              + 3 * e.shared_expert_intermediate_size // t + e.num_experts + expert_buffers(m, group))
    return max(dense, sparse)


def layer_expert_elements(m: ModelConfig, expert: int = 1, t: int = 1) -> int:
    """Elements of one sparse layer's routed experts on a device once gathered over fsdp: split
    over the expert axis (E) and the tensor axis (Fe) only. 0 for a dense model."""
    if m.moe is None:
        return 0
    return 3 * m.moe.num_experts * m.hidden_size * m.moe.moe_intermediate_size // (expert * t)


def mlp_flops(m: ModelConfig) -> int:
    """Multiply-adds per token of all layers' MLPs (routed experts, shared expert and router where sparse)."""
    sparse = sum(m.sparse_layers)
    dense = (m.num_layers - sparse) * 3 * m.hidden_size * m.intermediate_size
    if m.moe is None:
        return dense
    e = m.moe
    return dense + sparse * m.hidden_size * (
        3 * (e.num_experts_per_tok * e.moe_intermediate_size + e.shared_expert_intermediate_size) + e.num_experts)


def experts_touched(num_experts: int, k: int, tokens):
    """Expected distinct experts a layer runs for `tokens` tokens (a number or an array) routed k
    of E each (uniformly): E * (1 - (1 - k/E)^tokens). One token: k; many: all E."""
    return num_experts * (1.0 - (1.0 - k / num_experts) ** np.maximum(tokens, 0.0))


def expert_params(m: ModelConfig) -> int:
    """Parameters of every routed expert of every sparse layer (gate, up and down projections)."""
    if m.moe is None:
        return 0
    return sum(m.sparse_layers) * m.moe.num_experts * 3 * m.hidden_size * m.moe.moe_intermediate_size


def active_params(m: ModelConfig) -> int:
    """Parameters one token's forward uses: all but the routed experts it is not sent to."""
    if m.moe is None:
        return m.num_params()
    return m.num_params() - expert_params(m) * (m.moe.num_experts - m.moe.num_experts_per_tok) // m.moe.num_experts


def weight_share_read(m: ModelConfig, tokens):
    """Share of the weights' bytes a forward over `tokens` tokens (one decode step of that many
    slots; a number or an array of them) reads: all of a dense model; of a MoE model the
    non-expert weights and, per sparse layer, the experts touched (`experts_touched`)."""
    if m.moe is None:
        return 1.0
    e = m.moe
    touched = experts_touched(e.num_experts, e.num_experts_per_tok, tokens) / e.num_experts
    return 1.0 - _routed_share(m) * (1.0 - touched)


@functools.lru_cache(maxsize=64)
def _routed_share(m: ModelConfig) -> float:
    """The routed experts' share of the parameters (cached: the simulator asks once per decode chunk)."""
    return expert_params(m) / m.num_params()


def temporaries(spec: ProgramSpec, ctx: EstimateContext, attention: Sequence[str] = ()) -> int:
    """Modelled temporaries (and new outputs) of one program on one device, in bytes.
    `attention`: the kernels compiled into it; a flash or paged kernel keeps no score tensor."""
    flash = any(k in FLASH_KERNELS for k in attention)
    paged = any(k in PAGED_KERNELS for k in attention)
    ctx = ctx.for_spec(spec)
    m, d = ctx.model, _dims(spec.name)
    kind = _kind(spec.name)
    D, N, K, H, V, L = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size, m.num_layers
    if kind in ("score", "choices", "loglik"):  # a learned reward's whole forward, nothing cached
        R, T = d.get("rows", 1), d.get("len", 1)
        acts = ctx.cache_bytes * R * T * (2 * D + mlp_acts(m))  # one layer's, in the weights' dtype
        scores = 4 * R * N * T * (1 if flash else T)
        if kind == "loglik":  # every position's logits and log-softmax, a chunk of positions at a time
            head = 2 * 4 * R * chunk_layout(R, T, ctx.logit_chunk_tokens)[1] * V
        else:  # the last position's logits (and log-softmax)
            head = 4 * R * (2 * V if kind == "choices" else 1)
        return acts + scores + 4 * R * T * D + head  # + the final hidden states (fp32)
    if spec.role in ("generation", "eval", "reward"):
        t = ctx.generation_tensor
        if kind == "decode":
            W = d.get("window", 1)
            if _is_paged(spec.args[1]):  # pools: the slots are the tokens' rows
                B = _first_dim(spec.args[2])
                # The reference gathers one layer's M pages per slot (keys and values) before attending.
                gather = 0 if paged else 2 * B * W * max(K // t, 1) * H * ctx.cache_bytes
            else:
                B, gather = _first_dim(spec.args[1]), 0  # the dense cache's slots on this device
            scores = 0 if paged else 2 * (N // t) * W
            return 4 * B * (3 * V // t + scores + mlp_acts(m, t) + 4 * D) + gather
        if kind in ("prefill_start", "prefill"):  # chunked: `prefill_chunk` queries at a time
            R, P = d.get("rows", 1), d.get("len", 1)
            C = min(ctx.prefill_chunk, P)
            block = 2 * L * R * max(K // t, 1) * P * H * ctx.cache_bytes  # the new KV block (an output)
            acts = ctx.cache_bytes * R * C * (2 * D + mlp_acts(m, t))  # in the weights' dtype
            scores = 4 * R * (N // t) * C * (1 if flash else C)
            return block + acts + scores + 4 * R * V
        if kind == "reprefill_packed":  # causal blocks over packed rows, written straight into slots
            R, W = d.get("rows", 1), _last_dim(spec.args[-1])
            bq = max(32, -(-W // 32))
            return ctx.cache_bytes * R * W * (2 * D + mlp_acts(m, t)) + 4 * R * (N // t) * bq * (1 if flash else W)
        if kind == "split_weights":
            return bytes_per_device(spec.args)  # the per-layer copy of the stacked weights
        return 0  # insert, first_tokens: in place or small
    if spec.role == "transfer":
        return 2 * bytes_per_device(spec.args) * ctx.compute_bytes // 4
    f, t, ex = ctx.fsdp, ctx.train_tensor, ctx.train_expert
    params = bytes_per_device(spec.args[0]) if spec.args else 0
    # The gradient (fp32, like the trained weights: the grad program's accumulator argument; with
    # LoRA the adapters alone) and the weight count (a LoRA base is bf16, not 4 bytes a weight).
    grads = bytes_per_device(spec.args[1]) if kind == "grad" else params
    weights = _elements_per_device(spec.args[0]) if spec.args else 0
    if kind == "update":
        return 0  # AdamW updates weights and moments in place (all donated)
    if kind in ("grad", "logprobs"):
        R, T = d.get("rows", 1), d.get("len", 1)
        Rl = max(1, R // (f * ex))  # rows shard over fsdp x expert
        group = ex if R % (f * ex) == 0 else 1  # a sparse layer gathers its expert group's rows
        tokens = Rl * T
        layer_weights = ctx.compute_bytes * weights * f // max(L, 1)  # one layer gathered (over fsdp)
        # One layer's activations and their gradients (compute dtype, two copies: fp32-sized).
        recompute = 4 * tokens * (4 * D + mlp_acts(m, t, group))
        attention = 4 * Rl * (N // t) * T * (2 if flash else T // 2)  # flash: log-sum-exp (and its gradient)
        # The logits are chunked over the micro-batch's tokens, every device's rows together
        # (ppo/logprobs.chunk_layout): a chunk holds this device's rows x Tc positions.
        _, tc = chunk_layout(R, T, ctx.logit_chunk_tokens)
        logits = 4 * Rl * tc * V // t * 2  # the chunk's fp32 logits and, in the backward, their gradient
        hidden = tokens * D * ctx.compute_bytes  # the final hidden states the chunks read
        # The head's chunks and the layers run one after the other (forward: layers then head;
        # backward: head then layers), so only the larger of the two is live at the peak.
        if kind == "logprobs":  # nothing kept for a backward; a layer gathered while the next one's gather runs
            return max(logits // 2, recompute // 4) + hidden + 4 * tokens + 2 * layer_weights
        saved = (L * tokens * D * ctx.compute_bytes if ctx.remat == "full"
                 else L * (recompute + attention) // 2)
        # A sparse layer's experts go through the grouped matmul's kernels, calls XLA does not
        # overlap with the collectives around them: the backward holds the layer's expert gradient
        # whole over fsdp (fp32, before its reduce-scatter) while the next layer's experts are
        # gathered (compiled 235B-A22B: 16 GiB above the terms before these on v5p, 3-9 on H100).
        experts = layer_expert_elements(m, ex, t) * (4 + ctx.compute_bytes)
        return saved + max(recompute + attention, logits + hidden) + grads + layer_weights + experts
    return 0


def estimate_peak(spec: ProgramSpec, ctx: EstimateContext, attention: Sequence[str] = ()) -> int:
    """Arguments + residents (exact) + modelled temporaries, bytes per device."""
    return bytes_per_device(spec.args) + bytes_per_device(spec.resident) + temporaries(spec, ctx, attention)


def lower_bound_peak(spec: ProgramSpec, ctx: EstimateContext) -> int:
    """The estimate with attention as its kernels need it (no score tensors), whatever is
    compiled: what the planner refuses on before compiling, as no attention implementation
    needs less."""
    return estimate_peak(spec, ctx, FLASH_KERNELS + PAGED_KERNELS)


def _is_paged(tree) -> bool:
    import jax

    from areal_jax.kernels.paged_attention import PagePool

    return any(isinstance(x, PagePool) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, PagePool)))


def _elements_per_device(tree) -> int:
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        total += math.prod(sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape)
    return total


def _first_dim(tree) -> int:
    import jax

    leaf = jax.tree.leaves(tree)[0]
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    return int(shape[0])


def _last_dim(x) -> int:
    return int(x.shape[-1]) if hasattr(x, "shape") and x.shape else 0


def relative_error(estimate: float, measured: float) -> float:
    return abs(estimate - measured) / max(measured, 1.0) if math.isfinite(measured) else math.inf


def analytic_flops(spec: ProgramSpec, ctx: EstimateContext, num_devices: int) -> float:
    """Matmul and attention FLOPs of one program per device, counted from the model's dimensions.

    XLA's cost analysis counts the body of a loop once: the layers of a scanned forward (training)
    and the query chunks of a chunked prefill are then undercounted by their trip count, so the
    planner takes the larger of XLA's figure and this one. Decode chunks count one step either way
    (XLA's figure is used: their layers are unrolled)."""
    ctx = ctx.for_spec(spec)
    m, d, kind = ctx.model, _dims(spec.name), _kind(spec.name)
    D, N, K, H, V, L = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size, m.num_layers
    layers = 2 * (L * (D * (N + 2 * K) * H + N * H * D) + mlp_flops(m))  # per token
    head = 2 * D * V

    def attention(queries: float, keys: float) -> float:  # QK^T and PV over every layer
        return 4.0 * L * N * H * queries * keys

    if kind in ("grad", "logprobs"):
        tokens = d.get("rows", 1) * d.get("len", 1)
        body = tokens * layers + attention(tokens, d.get("len", 1) / 2)
        forward = body + tokens * head
        # Backward twice the forward; remat "full" runs the layers' forward again, and chunked
        # logits (ppo/logprobs.py checkpoints each chunk) the head's.
        chunked = chunk_layout(d.get("rows", 1), d.get("len", 1), ctx.logit_chunk_tokens)[0] > 1
        again = (body if ctx.remat == "full" else 0) + (tokens * head if chunked else 0)
        total = forward if kind == "logprobs" else 3 * forward + again
    elif kind in ("prefill_start", "prefill", "score", "choices", "loglik"):  # the last three: a learned reward's
        R, P = d.get("rows", 1), d.get("len", 1)
        total = (R * P * layers + attention(R * P, P / 2)
                 + {"score": 0, "loglik": R * P * head}.get(kind, R * head))  # loglik: every position's logits
    elif kind == "reprefill_packed":
        R, W = d.get("rows", 1), _last_dim(spec.args[-1])
        total = R * W * layers + attention(R * W, W / 4)  # several sequences share a row
    else:
        return 0.0
    return total / max(num_devices, 1)
