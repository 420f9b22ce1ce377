"""Reference side of the parity tests: runs under .venv-ref (Python 3.11, torch CPU, transformers).

Reads one JSON request on stdin, writes one JSON reply line on stdout. Ops:
  make_model     {family, config, out, seed, max_shard_size?}: random model saved in HF format
  logits         {model, sequences, out}: fp32 logits of each unpadded sequence -> out (.npz)
  chat_template  {tokenizer, conversations, add_generation_prompt}: rendered text and ids
  generate       {model, prompts, max_new_tokens}: greedy continuation of each prompt
  make_adapter   {model, out, rank, alpha, targets, seed}: random PEFT LoRA adapter (B nonzero) saved
                 by PeftModel.save_pretrained
  adapter_logits {model, adapter, sequences, out}: `logits` of PeftModel.from_pretrained(base, adapter)
  many           {requests}: several of the above in one process
  make_model with head="score": a *ForSequenceClassification model (config carries num_labels,
                 pad_token_id)
  seq_scores     {model, sequences, tokenizer?, conversations?}: a reward model's score of each
                 sequence alone, and of all in one right- and one left-padded batch (attention mask,
                 positions counted from each row's first token); conversations are rendered by the
                 tokenizer's chat template first (their ids are returned)
"""

import json
import sys

import numpy as np
import torch
import transformers

CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "qwen2_moe": transformers.Qwen2MoeConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
}


def make_model(family, config, out, seed=0, max_shard_size=None, head="causal"):
    torch.manual_seed(seed)
    cfg = CONFIG_CLASSES[family](**config)
    auto = transformers.AutoModelForSequenceClassification if head == "score" else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=torch.float32)
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return {"params": sum(p.numel() for p in model.parameters())}


def _load(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def logits(model, sequences, out):
    m = _load(model)
    arrays = {}
    for i, seq in enumerate(sequences):
        ids = torch.tensor([seq], dtype=torch.long)
        arrays[f"logits_{i}"] = m(input_ids=ids).logits[0].float().numpy()
    np.savez(out, **arrays)
    return {"n": len(sequences)}


def chat_template(tokenizer, conversations, add_generation_prompt=True):
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    texts, ids = [], []
    for conv in conversations:
        texts.append(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt))
        enc = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=add_generation_prompt)
        if hasattr(enc, "keys"):
            enc = enc["input_ids"]
        ids.append(list(map(int, enc)))
    return {"texts": texts, "ids": ids}


@torch.no_grad()
def generate(model, prompts, max_new_tokens):
    m = _load(model)
    outs = []
    for p in prompts:
        ids = torch.tensor([p], dtype=torch.long)
        g = m.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                       pad_token_id=0, eos_token_id=None)
        outs.append(g[0, len(p):].tolist())
    return {"tokens": outs}


def many(requests):
    """Runs several requests in one interpreter (torch import is the slow part)."""
    return {"results": [OPS[r.pop("op")](**r) for r in requests]}


OPS = {"make_model": make_model, "logits": logits, "chat_template": chat_template, "generate": generate,
       "many": many}

def _tokenizer_report(path, chats=(), texts=(), id_lists=()):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    rendered = []
    for chat in chats:
        kw = dict(add_generation_prompt=chat.get("add_generation_prompt", False), tools=chat.get("tools"),
                  **chat.get("template_kwargs", {}))
        try:
            text = tok.apply_chat_template(chat["messages"], tokenize=False, **kw)
            ids = tok.apply_chat_template(chat["messages"], tokenize=True, return_dict=False, **kw)
            rendered.append({"text": text, "ids": list(map(int, ids))})
        except Exception as e:  # noqa: BLE001 - the test compares the message
            rendered.append({"error": f"{type(e).__name__}: {e}"})
    return {
        "chats": rendered,
        "encode": [tok.encode(t, add_special_tokens=True) for t in texts],
        "encode_plain": [tok.encode(t, add_special_tokens=False) for t in texts],
        "decode": [tok.decode(i) for i in id_lists],
        "decode_skip": [tok.decode(i, skip_special_tokens=True) for i in id_lists],
        "special": {k: getattr(tok, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        "len": len(tok),
    }


def tokenizer_parity(requests):
    """For each {path, chats: [{messages, add_generation_prompt, tools, template_kwargs}], texts, id_lists}:
    chat renderings (text and ids, or the error), encodings, decodings and special ids."""
    return {"results": [_tokenizer_report(**r) for r in requests]}


OPS["tokenizer_parity"] = tokenizer_parity


def make_adapter(model, out, rank, alpha, targets, seed=0):
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                             init_lora_weights=False)  # False: B random too, so the update is not zero
    m = peft.get_peft_model(_load(model), config)
    m.save_pretrained(out)
    return {"trainable": sum(p.numel() for p in m.parameters() if p.requires_grad)}


@torch.no_grad()
def adapter_logits(model, adapter, sequences, out):
    import peft

    m = peft.PeftModel.from_pretrained(_load(model), adapter).eval()
    arrays = {}
    for i, seq in enumerate(sequences):
        arrays[f"logits_{i}"] = m(input_ids=torch.tensor([seq], dtype=torch.long)).logits[0].float().numpy()
    np.savez(out, **arrays)
    return {"n": len(sequences)}


OPS.update(make_adapter=make_adapter, adapter_logits=adapter_logits)


@torch.no_grad()
def seq_scores(model, sequences=None, tokenizer=None, conversations=None):
    m = transformers.AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32).eval()
    if conversations is not None:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
        sequences = []
        for conv in conversations:
            enc = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=False)
            sequences.append(list(map(int, enc["input_ids"] if hasattr(enc, "keys") else enc)))
    pad = m.config.pad_token_id
    alone = [m(input_ids=torch.tensor([s])).logits[0].tolist() for s in sequences]
    T = max(map(len, sequences))
    batched = {}
    for side in ("right", "left"):
        ids = torch.full((len(sequences), T), pad, dtype=torch.long)
        mask = torch.zeros((len(sequences), T), dtype=torch.long)
        for b, s in enumerate(sequences):
            span = slice(0, len(s)) if side == "right" else slice(T - len(s), T)
            ids[b, span] = torch.tensor(s)
            mask[b, span] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        batched[side] = m(input_ids=ids, attention_mask=mask, position_ids=positions).logits.tolist()
    return {"ids": sequences, "alone": alone, "right": batched["right"], "left": batched["left"]}


OPS["seq_scores"] = seq_scores


@torch.no_grad()
def answer_loglik(model, tokenizer, pairs):
    """Per (question, answer): the mean log-prob of the answer's tokens under a causal LM, the
    question rendered as a chat's user turn with the generation prompt, the answer as the
    assistant's turn when the full chat's rendering begins with the prompt's, else appended."""
    m = _load(model)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)

    def ids(conv, gen):
        enc = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)
        return list(map(int, enc["input_ids"] if hasattr(enc, "keys") else enc))

    out = []
    for question, answer in pairs:
        user = [{"role": "user", "content": question}]
        prompt, full = ids(user, True), ids(user + [{"role": "assistant", "content": answer}], False)
        if not (full[:len(prompt)] == prompt and len(full) > len(prompt)):
            full = prompt + tok.encode(answer, add_special_tokens=False)
        logp = torch.log_softmax(m(input_ids=torch.tensor([full])).logits[0].float(), -1)
        target = torch.tensor(full[len(prompt):])
        out.append(float(logp[len(prompt) - 1:len(full) - 1].gather(-1, target[:, None]).mean()))
    return {"scores": out}


OPS["answer_loglik"] = answer_loglik

if __name__ == "__main__":
    torch.set_num_threads(2)
    request = json.loads(sys.stdin.read())
    op = request.pop("op")
    print(json.dumps(OPS[op](**request)))
