"""A tiny random reward model and judge saved locally (our writer, the chatml test tokenizer), for tests."""

from __future__ import annotations

import pathlib
import shutil

from areal_jax.models import ModelConfig, init_params, save_params
from areal_jax.models.reward_head import ScoreHead, init_score_head, save_reward_params
from tests.tokenizer_fixtures import build_tiny_tokenizer

CFG = ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, family="qwen2", qkv_bias=True)


def build_rm_and_judge(root: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """(tokenizer dir, reward-model dir, judge dir) under `root`: random weights (std 0.3, so the
    scores differ between inputs), the tokenizer copied into both model directories."""
    tok_dir = build_tiny_tokenizer(root / "tok", "chatml")
    rm_params = {k: v for k, v in init_params(CFG, 6, std=0.3).items() if k != "lm_head"}
    rm_params["score"] = init_score_head(CFG, ScoreHead(), 7, std=0.5)
    save_reward_params(rm_params, CFG, ScoreHead(pad_token_id=0), root / "rm")
    save_params(init_params(CFG, 8, std=0.3), CFG, root / "judge")
    for d in (root / "rm", root / "judge"):
        for f in tok_dir.iterdir():
            shutil.copy(f, d / f.name)
    return tok_dir, root / "rm", root / "judge"
