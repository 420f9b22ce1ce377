"""The arithmetic task's tokenizer and model directory, built locally (no model hub).

`build_tokenizer(dir)` writes a Hugging Face tokenizer directory that
`areal_jax.models.tokenizer.Tokenizer.from_pretrained` loads (the path users' real models
take): a character-level `tokenizer.json` (every printable ASCII character and newline is one
token, so each digit is its own token, which is what small models need to learn carrying),
``\\boxed`` as one token, a short chat template and eos/pad tokens.

`task_model_config(vocab_size)` is a Qwen2-style decoder of about 0.8M parameters that trains in
minutes on a CPU; `build_task_model_dir(dir)` writes tokenizer + randomly initialized weights as
one HF checkpoint directory.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from areal_jax.paths import write_whole
from areal_jax.models.config import ModelConfig, MoEConfig
from areal_jax.models.hf_io import save_params
from areal_jax.models.transformer import init_params

PAD, UNK, EOS = "<|pad|>", "<|unk|>", "<|end|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = (PAD, UNK, EOS, *ROLE_TOKENS.values())
# Multi-character tokens that are ordinary text (decode keeps them).
WORD_TOKENS = ("\\boxed",)
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))

# <|role|>content<|end|> per message; the generation prompt opens the assistant turn, whose
# completion ends with <|end|> (= eos), so SFT targets and sampling stop at the same token.
# Tools (hermes style, as Qwen2.5 writes calls): a system turn naming each tool and its parameters
# first ("Tools: calculator(expression)": short, as a character-level model reads every character),
# an assistant turn's calls as <tool_call>{"name": ..., "arguments": ...}</tool_call> after its
# content, a tool result as a user turn <tool_response>...</tool_response>. Without tools, tool
# calls and tool results the rendering is unchanged.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|system|>Tools: ' }}"
    "{%- for tool in tools %}{%- set fn = tool.function if tool.function is defined else tool %}"
    "{{- fn.name + '(' + (fn.parameters.properties | list | join(', ')) + ')' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}{{- '<|end|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('Unsupported role: ' + message.role) }}"
    "{%- endif %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|user|><tool_response>' + message.content + '</tool_response><|end|>' }}"
    "{%- else %}"
    "{{- '<|' + message.role + '|>' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '<tool_call>{\"name\": ' + fn.name | tojson + ', \"arguments\": ' + fn.arguments | tojson + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)


def vocabulary() -> dict[str, int]:
    """Token -> id: special tokens first (pad = 0), then word tokens, then the characters."""
    tokens = [*SPECIAL_TOKENS, *WORD_TOKENS, *ALPHABET]
    return {t: i for i, t in enumerate(tokens)}


def build_tokenizer(directory: str | pathlib.Path) -> pathlib.Path:
    """Writes tokenizer.json, tokenizer_config.json and generation_config.json into `directory`.

    Each file appears whole (written beside it, then renamed): the processes of a multi-host run
    all build it into the one run directory, and one must never read another's half-written file.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary()
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # One pre-token per character (newline included); WordLevel maps each to its id.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # concatenate tokens, no spaces in between
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in WORD_TOKENS])
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    write_whole(directory / "tokenizer.json", backend.to_str(pretty=True))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
    }
    write_whole(directory / "tokenizer_config.json", json.dumps(config, indent=2))
    write_whole(directory / "generation_config.json",
                 json.dumps({"eos_token_id": vocab[EOS], "pad_token_id": vocab[PAD]}, indent=2))
    return directory


def task_model_config(vocab_size: int | None = None, *, hidden_size: int = 128, num_layers: int = 4,
                      num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 384,
                      max_position_embeddings: int = 256, num_experts: int = 0,
                      num_experts_per_tok: int = 2) -> ModelConfig:
    """A small Qwen2-style decoder for the task (defaults: ~0.8M parameters, tied embeddings).

    num_experts > 0: its Qwen2-MoE variant, every MLP an expert block of `num_experts` experts
    (`num_experts_per_tok` per token) of intermediate_size / 4 hidden units beside a shared expert
    of intermediate_size / 3, so a token's active MLP (2 experts + shared) matches the dense one.
    """
    vocab = vocabulary()
    moe = None
    if num_experts:
        moe = MoEConfig(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                        moe_intermediate_size=intermediate_size // 4,
                        shared_expert_intermediate_size=intermediate_size // 3, router_aux_loss_coef=0.001)
    return ModelConfig(
        vocab_size=vocab_size or len(vocab), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True,
        max_position_embeddings=max_position_embeddings, family="qwen2_moe" if moe else "qwen2",
        eos_token_id=vocab[EOS], moe=moe)


def build_task_model_dir(directory: str | pathlib.Path, cfg: ModelConfig | None = None, *, seed: int = 0,
                         params=None) -> pathlib.Path:
    """Writes tokenizer + config.json + safetensors (random init, or `params`) as one HF directory."""
    directory = build_tokenizer(directory)
    cfg = cfg or task_model_config()
    if params is None:
        params = init_params(cfg, jax.random.key(seed), jnp.float32)
    save_params(params, cfg, directory)
    return directory
