"""Torch (transformers, CPU) half of the side-by-side benchmarks; runs under .venv-ref.

Reads a JSON request on stdin, prints one JSON line. Ops:
  make_model {out, config, seed}                        random Qwen2 checkpoint saved for both sides
  forward    {model, rows: [[ids]], iters, threads}     tokens/s of a full forward over the rows
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


@torch.no_grad()
def forward(model, rows, iters, threads):
    torch.set_num_threads(threads)
    m = _load(model)
    ids = torch.tensor(rows, dtype=torch.long)
    m(input_ids=ids)  # warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        m(input_ids=ids)
    dt = (time.perf_counter() - t0) / iters
    return {"seconds_per_iter": dt, "tokens_per_s": ids.numel() / dt}


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
