"""Evaluation runner: sample a model on prompt rows, score the samples, report pass@k / maj@k.

`run_evaluation` is the backend of ``areal-jax eval``. One `GenerationEngine` takes every
prompt at once (continuous batching keeps its slots full) and is driven to idle from the
calling thread. Each finished group is decoded as soon as the engine hands it back and, when
a `RewardPool` is given, its samples are sent to the pool right away, so scoring in worker
processes overlaps the rest of generation. Without a pool the reward runs in this process
after generation, with no deadline: that path is for cheap, trusted rewards (math-verify can
stall on adversarial input; give it a pool).

Decisions worth knowing:

- A sample is *correct* when its reward is >= `correct_threshold` (1.0: the built-in math and
  code rewards give 1.0 or 0.0). pass@k is the unbiased estimator over the n samples;
  "accuracy" is the mean fraction of correct samples per prompt (pass@1 whatever n is).
- maj@k votes over the *extracted answers* of the first k samples (`answer_extractor`;
  "boxed": the last ``\\boxed{...}``, whitespace-stripped; samples without one cast no vote)
  and scores the winner by its first sample's correctness (see areal_jax.eval_metrics).
- Greedy decoding (temperature 0) requires n_samples == 1: greedy samples of one prompt are
  identical, so n > 1 would only repeat work and make pass@k look like a sampled estimate.
- Rewards from a pool that time out, crash or raise score 0.0 (the pool's contract) and are
  counted in ``reward_failures``; an in-process reward that raises stops the evaluation.
- The engine runs where the params live. ``areal-jax eval`` loads them in `dtype` straight onto
  `engine_mesh`: a host-local ("data", "tensor") mesh over every local device, `tensor_parallel`
  devices per model replica and the slots split evenly over the replicas ("data"); each device
  reads its own slice of the checkpoint. A `tensor_parallel` that would leave weights whole on every device
  (heads, kv heads, MLP or vocabulary not divisible by it) is refused, not replicated.
- Several processes (``jax.distributed``, e.g. ``areal-jax eval --distributed`` on a TPU pod):
  process p generates and scores rows p, p + P, p + 2P, ... on its own devices (its own mesh);
  the samples are then gathered so that every process returns the same report, built from the
  rows in file order. Generation and scoring times are the slowest process's; only process 0 writes
  `out_path`.
- Metrics are reported overall and per dataset file: `row.source` without its trailing
  ``:line`` (JSONL) or ``[row]`` (Parquet, `datasets`). Timings exist only overall, since all
  datasets share one engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from areal_jax import paths
from areal_jax.config_system import ConfigError
from areal_jax.data.examples import PromptExample, prompt_example
from areal_jax.answers import extract_last_boxed
from areal_jax.data.pipeline import PromptLoader
from areal_jax.eval_metrics import PromptSamples, summarize
from areal_jax.evaluation.held_out import SampledGroup, rewards, sample
from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams
from areal_jax.generation.programs import slots_for_replicas, unsplit_tensor_axes
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Params, Transformer
from areal_jax.parallel.distributed import gather_json
from areal_jax.parallel.meshes import generation_mesh
from areal_jax.reward.composite import (JUDGE, TermsScorer, is_learned, normalize_reward, question_text,
                                        term_metrics)
from areal_jax.reward.judge_config import JudgeConfig
from areal_jax.reward.registry import load_reward_function
from areal_jax.reward.scoring import RewardScorer

__all__ = ["EvalConfig", "EvalReport", "dataset_of", "engine_mesh", "run_evaluation"]

logger = logging.getLogger(__name__)

WEIGHT_DTYPES = ("float32", "bfloat16")  # EvalConfig.dtype's choices

_EXTRACTOR_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# "path:12" (JSONL line) or "path[3]" (Parquet / datasets row): the dataset is "path".
_SOURCE_SUFFIX = re.compile(r"^(?P<path>.+?)(?::\d+|\[\d+\])$")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """How to sample and score an evaluation.

    n_samples: samples per prompt. temperature 0 is greedy and then needs n_samples == 1.
    ks: the k of pass@k and maj@k (each 1 <= k <= n_samples); stored sorted and deduplicated.
    reward: registered reward name ("math", "code") or "package.module:function", called as
        reward(completion_text, gold) with gold = row.answer (math) or row.test_cases (code); or
        weighted terms as RLVRConfig.reward takes them (verifiers, "rm:<dir>", "judge"), scored as
        the rollouts score them: a sample's reward is the weighted sum, and the report adds each
        term's "reward/<name>/mean" and "reward/<name>/failed". A sample is then correct by the
        first verifier term; with none, the report has no accuracy, pass@k or maj@k.
    judge: the JudgeConfig of a "judge" term.
    reward_timeout_s: per-call deadline in the RewardPool (in-process calls have none).
    correct_threshold: a sample is correct when its reward >= this.
    num_slots, max_seq_len, decode_chunk, seed: the generation engine's shape and sampling seed
        (max_seq_len bounds prompt + completion; a longer prompt is an error). num_slots counts
        every replica's slots, rounded up to a multiple of the replicas (local devices /
        tensor_parallel) so that each holds the same share.
    dtype: of the weights and the KV cache, "float32" or "bfloat16" (half the memory; its
        numbers differ from float32's).
    tensor_parallel: devices per model replica (heads, MLP and vocabulary split over them); the
        rest of this process's devices hold further replicas. It must divide the local device
        count and the model's heads, kv heads, intermediate size and vocabulary.
    answer_extractor: "boxed" or "package.module:function" (text -> str | None), the answer
        each sample votes for in maj@k.
    """

    n_samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    ks: tuple[int, ...] = (1,)
    reward: str | tuple[tuple[str, float], ...] = "math"
    judge: JudgeConfig | None = None
    reward_timeout_s: float = 10.0
    correct_threshold: float = 1.0
    num_slots: int = 32
    max_seq_len: int = 2048
    decode_chunk: int = 8
    seed: int = 0
    answer_extractor: str = "boxed"
    dtype: str = "float32"
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("n_samples", "max_new_tokens", "num_slots", "max_seq_len", "decode_chunk", "tensor_parallel"):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("top_k", self.top_k, minimum=0)
        _require_int("seed", self.seed, minimum=0)
        if not _is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"EvalConfig.temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature == 0.0 and self.n_samples != 1:
            raise ValueError(f"EvalConfig: temperature=0 (greedy) gives identical samples, so n_samples must be 1 "
                             f"(got n_samples={self.n_samples}); use temperature > 0 for pass@k with k > 1")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"EvalConfig.top_p must be in (0, 1], got {self.top_p!r}")
        if self.max_new_tokens >= self.max_seq_len:
            raise ValueError(f"EvalConfig.max_new_tokens={self.max_new_tokens} must be < max_seq_len="
                             f"{self.max_seq_len} (the prompt needs at least one position)")
        if isinstance(self.ks, (str, bytes)) or not isinstance(self.ks, Iterable):
            raise ValueError(f"EvalConfig.ks must be a sequence of ints, got {self.ks!r}")
        ks = tuple(self.ks)
        if not ks:
            raise ValueError("EvalConfig.ks must name at least one k")
        for k in ks:
            _require_int("ks entry", k, minimum=1)
            if k > self.n_samples:
                raise ValueError(f"EvalConfig.ks contains k={k} > n_samples={self.n_samples} "
                                 "(pass@k and maj@k need at least k samples per prompt)")
        object.__setattr__(self, "ks", tuple(sorted(set(ks))))
        object.__setattr__(self, "reward", normalize_reward(self.reward, "EvalConfig.reward"))
        if isinstance(self.judge, Mapping):  # a run's config.json holds it as a dict
            object.__setattr__(self, "judge", JudgeConfig(**self.judge))
        if self.judge is not None and not isinstance(self.judge, JudgeConfig):
            raise ValueError(f"EvalConfig.judge must be a JudgeConfig, got {type(self.judge).__name__}")
        if JUDGE in self.terms and self.judge is None:
            raise ValueError("EvalConfig.reward has a 'judge' term: set EvalConfig.judge (a JudgeConfig)")
        if not _is_real(self.reward_timeout_s) or not 0.0 < self.reward_timeout_s < math.inf:
            raise ValueError(f"EvalConfig.reward_timeout_s must be a positive finite number, "
                             f"got {self.reward_timeout_s!r}")
        if not _is_real(self.correct_threshold) or not math.isfinite(self.correct_threshold):
            raise ValueError(f"EvalConfig.correct_threshold must be a finite number, got {self.correct_threshold!r}")
        if self.answer_extractor != "boxed" and not (
                isinstance(self.answer_extractor, str) and _EXTRACTOR_PATH.match(self.answer_extractor)):
            raise ValueError(f"EvalConfig.answer_extractor must be 'boxed' or 'package.module:function', "
                             f"got {self.answer_extractor!r}")
        if self.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"EvalConfig.dtype must be one of {WEIGHT_DTYPES}, got {self.dtype!r}")


    @property
    def terms(self) -> tuple[str, ...]:
        """The reward's term names (a single reward is one term)."""
        return (self.reward,) if isinstance(self.reward, str) else tuple(name for name, _ in self.reward)

    @property
    def verifier(self) -> str | None:
        """The reward correctness is read from: the reward, or its first term that is not learned."""
        return next((name for name in self.terms if not is_learned(name)), None)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"EvalConfig.{name} must be an int >= {minimum}, got {value!r}")


def engine_mesh(model_cfg: ModelConfig, tensor_parallel: int, *, field: str = "EvalConfig.tensor_parallel",
                devices: Sequence[jax.Device] | None = None) -> Mesh | None:
    """The host-local ("data", "tensor") mesh an engine of this model runs on: every one of
    `devices` (default: this process's), `tensor_parallel` per replica. None on a single device
    (the weights stay on it). Raises ConfigError naming `field` where the split is impossible or
    would keep weights whole on every device."""
    devices = sorted(jax.local_devices() if devices is None else devices, key=lambda d: d.id)
    if len(devices) % tensor_parallel:
        raise ConfigError(f"{field} = {tensor_parallel} does not divide this process's {len(devices)} "
                          "local device(s): each model replica needs tensor_parallel of them")
    unsplit = unsplit_tensor_axes(model_cfg, tensor_parallel)
    if unsplit:
        sizes = ", ".join(f"{name} = {size}" for name, size in unsplit.items())
        raise ConfigError(f"{field} = {tensor_parallel} does not divide the model's {sizes}: those weights "
                          "would be replicated on every device instead of split (choose a divisor)")
    return generation_mesh(devices, tensor_parallel) if len(devices) > 1 else None


@dataclasses.dataclass(frozen=True)
class EvalReport:
    """Outcome of `run_evaluation`.

    overall: "pass@k" and "maj@k" for each k, "accuracy", "mean_reward", "num_prompts",
        "num_samples", "generated_tokens", "truncated_fraction" (samples that hit a length
        limit), "reward_failures" (pool timeouts/crashes/errors), "wall_s", "generation_s",
        "scoring_s" (from the end of generation to the last reward), "tokens_per_s".
    per_dataset: dataset file -> the same metrics without the timings.
    config: the EvalConfig as a plain dict.
    """

    overall: dict[str, float]
    per_dataset: dict[str, dict[str, float]]
    config: dict[str, Any]

    def to_json(self) -> str:
        """The report as indented JSON text."""
        return json.dumps({"config": self.config, "overall": self.overall, "per_dataset": self.per_dataset},
                          indent=2)


@dataclasses.dataclass(frozen=True)
class _Sample:
    """One scored sample: the row of the JSONL output."""

    query_id: str
    source: str
    dataset: str
    sample: int
    completion: str
    answer: str | None
    gold: str | None
    reward: float
    correct: bool
    stop_reason: str
    num_tokens: int
    terms: dict[str, float] | None = None  # a composite reward's term values
    failed_terms: tuple[str, ...] = ()  # its terms that failed (scored 0.0)


def dataset_of(source: str) -> str:
    """The dataset file of a row's `source`: "data/a.jsonl:12" -> "data/a.jsonl", "dir[3]" -> "dir"."""
    match = _SOURCE_SUFFIX.match(source)
    return match.group("path") if match else source


def run_evaluation(model: Transformer | tuple[ModelConfig, Params], tokenizer: Any, rows: Iterable[Mapping[str, Any]],
                   config: EvalConfig, *, reward_pool: Any = None,
                   out_path: str | pathlib.Path | None = None) -> EvalReport:
    """Sample `config.n_samples` completions per row, score them, and report pass@k / maj@k.

    model: a `Transformer` or `(ModelConfig, params)`; the engine runs where the params live (on
        their generation mesh, `engine_mesh`, or their single device). `config.dtype` and
        `tensor_parallel` are the loader's (``areal-jax eval``); here the params are taken as given.
    tokenizer: decodes completions (special tokens skipped) and gives `stop_token_ids`.
    rows: a finite iterable of loader examples ``{"prompt_ids", "row": PromptRow}`` (for a
        `PromptLoader`, build it with ``num_epochs=1``; ``shuffle=False, even_shards=False``
        keeps every row in file order).
    reward_pool: a `RewardPool` to score in worker processes with deadlines; None scores
        in this process.
    out_path: where to write one JSON line per sample (rows in order, then sample index);
        process 0 writes it.

    With several JAX processes every process must call this with the same rows; each evaluates
    its share (module docstring) and all return the whole report.
    """
    if not isinstance(config, EvalConfig):
        raise TypeError(f"config must be an EvalConfig, got {type(config).__name__}")
    if isinstance(rows, PromptLoader) and rows.dataset.config.num_epochs is None:
        raise ValueError("rows is a PromptLoader that repeats forever (num_epochs=None); build it with num_epochs=1")
    model_cfg, params = (model.config, model.params) if isinstance(model, Transformer) else model
    examples = [_checked_example(i, row, model_cfg, config) for i, row in enumerate(rows)]
    if not examples:
        raise ValueError("run_evaluation: no rows to evaluate")
    # Name problems (unknown reward, bad extractor) before minutes of generation; with a pool the
    # calls run there under the deadline, else in this process after generation.
    composite = not isinstance(config.reward, str)
    scorer = None if composite else RewardScorer(config.reward, reward_pool, timeout_s=config.reward_timeout_s)
    extract = _load_extractor(config.answer_extractor)
    failures_before = _pool_failures(reward_pool)

    t_start = time.perf_counter()
    process, processes = jax.process_index(), jax.process_count()
    mine = list(range(process, len(examples), processes))
    local, generation_s, engine_tokens = _generate(model_cfg, params, tokenizer, [examples[i] for i in mine],
                                                   config, scorer)

    t_scoring = time.perf_counter()
    samples_of: dict[int, list[_Sample]] = {}
    scored = _scored(local, config, scorer, reward_pool)
    for i, group, group_scores in zip(mine, local, scored, strict=True):
        row = group.example.row
        samples_of[i] = [
            _Sample(query_id=group.example.query_id, source=row.source, dataset=dataset_of(row.source), sample=j,
                    completion=text, answer=extract(text), gold=row.answer, reward=reward,
                    correct=correct, stop_reason=c.stop_reason, num_tokens=int(len(c.tokens)),
                    terms=terms, failed_terms=failed)
            for j, (c, text, (reward, correct, terms, failed))
            in enumerate(zip(group.result.completions, group.texts, group_scores))]
    scoring_s = time.perf_counter() - t_scoring
    failures = _pool_failures(reward_pool) - failures_before
    if processes > 1:
        parts = gather_json({"samples": {str(i): [dataclasses.asdict(x) for x in g] for i, g in samples_of.items()},
                             "generation_s": generation_s, "scoring_s": scoring_s,
                             "engine_tokens": engine_tokens, "failures": failures})
        samples_of = {int(i): [_Sample(**{**x, "failed_terms": tuple(x["failed_terms"])}) for x in g]
                      for part in parts for i, g in part["samples"].items()}
        generation_s = max(part["generation_s"] for part in parts)
        scoring_s = max(part["scoring_s"] for part in parts)
        engine_tokens = sum(part["engine_tokens"] for part in parts)
        failures = sum(part["failures"] for part in parts)
    samples = [samples_of[i] for i in range(len(examples))]
    wall_s = time.perf_counter() - t_start

    if out_path is not None and process == 0:
        _write_jsonl(paths.as_path(out_path), samples)
    overall = _metrics(samples, config)
    if overall["generated_tokens"] != engine_tokens:  # an accounting slip would skew tokens_per_s
        logger.warning("completions hold %d tokens but the engine counted %d", overall["generated_tokens"],
                       engine_tokens)
    overall.update(
        reward_failures=failures,
        wall_s=wall_s, generation_s=generation_s, scoring_s=scoring_s,
        tokens_per_s=overall["generated_tokens"] / generation_s if generation_s > 0 else 0.0)
    by_dataset: dict[str, list[list[_Sample]]] = {}
    for group in samples:
        by_dataset.setdefault(group[0].dataset, []).append(group)
    per_dataset = {name: _metrics(groups_, config) for name, groups_ in by_dataset.items()}
    return EvalReport(overall=overall, per_dataset=per_dataset, config=dataclasses.asdict(config))


def _scored(groups: list[SampledGroup], config: EvalConfig, scorer: RewardScorer | None, pool: Any
            ) -> list[list[tuple[float, bool, dict[str, float] | None, tuple[str, ...]]]]:
    """(reward, correct, term values, failed terms) of each group's samples: by the single reward,
    or by every term of a composite one (`TermsScorer`, its learned models loaded here)."""
    if scorer is not None:
        return [[(r, r >= config.correct_threshold, None, ()) for r in rs] for rs in rewards(groups, scorer)]
    terms = TermsScorer(config.reward, pool=pool, timeout_s=config.reward_timeout_s, judge=config.judge)
    try:
        items = [(question_text(g.example), text, g.example.gold) for g in groups for text in g.texts]
        flat_rewards, values, failures, _ = terms.score(items)
    finally:
        terms.close()
    verifier = config.verifier
    flat = [(r, verifier is not None and v[verifier] >= config.correct_threshold, v, failed)
            for r, v, failed in zip(flat_rewards, values, failures, strict=True)]
    out, at = [], 0
    for g in groups:
        out.append(flat[at:at + len(g.texts)])
        at += len(g.texts)
    return out


def _generate(model_cfg: ModelConfig, params: Params, tokenizer: Any, examples: list[PromptExample],
              config: EvalConfig, scorer: RewardScorer | None) -> tuple[list[SampledGroup], float, int]:
    """`held_out.sample` of `config.n_samples` completions per example on one engine of its own;
    returns the groups, the generation seconds and the engine's generated tokens."""
    if not examples:  # a process with no rows (fewer rows than processes)
        return [], 0.0, 0
    t_start = time.perf_counter()
    n = config.n_samples
    # num_slots, or fewer when fewer samples need them, as an equal share per data replica.
    slots = slots_for_replicas(min(config.num_slots, len(examples) * n), params)
    engine = GenerationEngine((model_cfg, params), EngineConfig(
        num_slots=slots, max_seq_len=config.max_seq_len,
        decode_chunk=config.decode_chunk, seed=config.seed))
    sampling = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=float(config.temperature),
                              top_p=config.top_p, top_k=config.top_k,
                              stop_token_ids=tuple(tokenizer.stop_token_ids))
    groups = sample(engine, examples, sampling, scorer, tokenizer, n=n)
    generation_s = time.perf_counter() - t_start
    engine_tokens = engine.stats().generated_tokens
    del engine  # frees its KV cache before scoring
    return groups, generation_s, engine_tokens


def _checked_example(index: int, row: Any, model_cfg: ModelConfig, config: EvalConfig) -> PromptExample:
    try:
        example = prompt_example(row)
    except (TypeError, ValueError) as e:
        raise type(e)(f"row {index}: {e}") from None
    length = len(example.prompt_ids)
    if not 1 <= length < config.max_seq_len:
        raise ValueError(f"row {index} ({example.source}): prompt of {length} tokens does not fit max_seq_len="
                         f"{config.max_seq_len} (prompt + at least one generated token)")
    if example.prompt_ids.max() >= model_cfg.vocab_size or example.prompt_ids.min() < 0:
        raise ValueError(f"row {index} ({example.source}): prompt token ids outside the model's vocabulary "
                         f"[0, {model_cfg.vocab_size})")
    return example


def _load_extractor(name: str) -> Callable[[str], str | None]:
    """The maj@k answer of a completion: stripped, with empty answers counted as no answer."""
    raw = extract_last_boxed if name == "boxed" else load_reward_function(name)

    def extract(text: str) -> str | None:
        answer = raw(text)
        if answer is None:
            return None
        if not isinstance(answer, str):
            raise TypeError(f"answer_extractor {name!r} returned {type(answer).__name__}, expected str or None")
        return answer.strip() or None

    return extract


def _pool_failures(pool: Any) -> int:
    if pool is None:
        return 0
    stats = pool.stats()
    return stats.timeouts + stats.crashes + stats.errors


def _metrics(groups: list[list[_Sample]], config: EvalConfig) -> dict[str, float]:
    """pass@k / maj@k / accuracy over prompts (a reward with a verifier), plus sample and token
    counts, the mean reward and a composite reward's terms."""
    out: dict[str, float] = {}
    if config.verifier is not None:
        prompts = [PromptSamples(tuple(s.answer for s in g), tuple(s.correct for s in g)) for g in groups]
        out.update(summarize(prompts, config.ks))
    flat = [s for g in groups for s in g]
    if not isinstance(config.reward, str):
        out.update(term_metrics([{"reward_terms": {name: [sum(s.terms[name] for s in flat), len(flat),
                                                          sum(name in s.failed_terms for s in flat)]
                                                   for name in config.terms}}]))
    out["num_prompts"] = len(groups)
    out["num_samples"] = len(flat)
    out["mean_reward"] = sum(s.reward for s in flat) / len(flat)
    out["generated_tokens"] = sum(s.num_tokens for s in flat)
    out["truncated_fraction"] = sum(s.stop_reason == "length" for s in flat) / len(flat)
    return out


def _write_jsonl(path: paths.Path, samples: list[list[_Sample]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:  # local or remote (gs://): areal_jax.paths
        for group in samples:
            for s in group:
                row = dataclasses.asdict(s)
                if s.terms is None:  # a single reward: the terms' fields say nothing
                    del row["terms"], row["failed_terms"]
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
