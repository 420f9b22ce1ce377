"""`generate`: the offline convenience API over GenerationEngine (stable for users and scripts)."""

from __future__ import annotations

from collections.abc import Sequence

from areal_jax.generation.config import EngineConfig
from areal_jax.generation.engine import Completion, GenerationEngine
from areal_jax.generation.programs import slots_for_replicas
from areal_jax.generation.sampling import SamplingParams
from areal_jax.models.transformer import Transformer


def generate(model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, n: int = 1, seed: int = 0,
             stop_token_ids: Sequence[int] = (), num_slots: int | None = None,
             decode_chunk: int = 8) -> list[list[Completion]]:
    """Samples `n` completions for each prompt (lists of token ids); `temperature=0` is greedy.

    Returns, per prompt, `n` `Completion`s with `.tokens`, `.logprobs`, `.versions`,
    `.stop_reason` ('stop' when a stop token ended it, which is included, else 'length') and, for
    a MoE model, `.moe_routing` (the experts each input token was routed to; requests.Completion).
    """
    if not prompts:
        return []
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              stop_token_ids=tuple(stop_token_ids))
    longest = max(len(p) for p in prompts)
    max_seq_len = -(-(longest + max_new_tokens) // 16) * 16  # round up: fewer distinct programs
    slots = slots_for_replicas(num_slots or min(64, len(prompts) * n), model.params)
    engine = GenerationEngine(model, EngineConfig(num_slots=slots, max_seq_len=max_seq_len,
                                                  decode_chunk=decode_chunk, seed=seed))
    handles = [engine.submit(p, sampling, n=n) for p in prompts]
    engine.run_until_idle()
    return [h.result().completions for h in handles]
