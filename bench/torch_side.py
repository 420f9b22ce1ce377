"""Torch (transformers, CPU) half of the side-by-side benchmarks; runs under .venv-ref.

Reads a JSON request on stdin, prints one JSON line. Ops:
  make_model {out, config, seed}                        random Qwen2 checkpoint saved for both sides
  forward    {model, rows: [[ids]], iters, threads[, segments: [[seg ids]], sample: [stride, vocab]]}
                                                        tokens/s of a full forward over the rows; with
                                                        segments, rows hold packed sequences (causal within
                                                        a segment, positions restart per segment); logits
                                                        [:, ::stride, :vocab] come back for cross-checking
  generate   {model, prompts: [[ids]], max_new_tokens, iters, threads}  greedy generate tokens/s
"""

import json
import sys
import time

import torch
import transformers


def make_model(out, config, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return {"params": sum(p.numel() for p in model.parameters())}


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def packed_inputs(segments) -> dict:
    """position_ids and a 4-D boolean mask `[B, 1, T, T]` for rows of packed sequences.

    transformers does not separate packed sequences of a batch by itself (position_ids that
    restart per sequence still let every token see the earlier sequences of its row), so the
    block-causal mask is passed explicitly; sdpa takes it as is.
    """
    seg = torch.tensor(segments, dtype=torch.long)
    B, T = seg.shape
    idx = torch.arange(T)
    starts = torch.zeros_like(seg)  # index where each token's segment starts
    for b in range(B):
        first = torch.ones(T, dtype=torch.bool)
        first[1:] = seg[b, 1:] != seg[b, :-1]
        starts[b] = torch.cummax(torch.where(first, idx, 0), 0).values
    mask = (idx[:, None] >= idx[None, :])[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    return {"position_ids": idx[None] - starts, "attention_mask": mask[:, None]}


@torch.no_grad()
def forward(model, rows, iters, threads, segments=None, sample=(37, 64)):
    torch.set_num_threads(threads)
    m = _load(model)
    kw = {"input_ids": torch.tensor(rows, dtype=torch.long)}
    if segments is not None:
        kw.update(packed_inputs(segments))
    logits = m(**kw).logits  # warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        m(**kw)
    dt = (time.perf_counter() - t0) / max(iters, 1)
    return {"seconds_per_iter": dt, "tokens_per_s": kw["input_ids"].numel() / dt if iters else 0.0,
            "logits_sample": logits[:, ::sample[0], :sample[1]].tolist()}


@torch.no_grad()
def generate(model, prompts, max_new_tokens, iters, threads):
    torch.set_num_threads(threads)
    m = _load(model)
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = dict(attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
              do_sample=False, pad_token_id=0, eos_token_id=None)
    m.generate(ids, **kw)  # warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        out = m.generate(ids, **kw)
    dt = (time.perf_counter() - t0) / iters
    generated = (out.shape[1] - width) * len(prompts)
    return {"seconds_per_iter": dt, "tokens_per_s": generated / dt}


OPS = {"make_model": make_model, "forward": forward, "generate": generate}

if __name__ == "__main__":
    req = json.loads(sys.stdin.read())
    print(json.dumps(OPS[req.pop("op")](**req)))
