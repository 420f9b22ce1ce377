"""Multi-turn math: answer, and on a wrong answer read feedback and try again.

Use it from the command line (any math task: the built-in arithmetic, GSM8K, MATH):

    RLConfig.workflow = "areal_jax.workflows.multi_turn_math:MultiTurnMathWorkflow"
    MultiTurnMathConfig.max_turns = 2
    MultiTurnMathConfig.turn_discount = 0.9

configs/multi_turn_math.gin holds these lines for the quickstart (given after it:
`--gin_file=configs/quickstart.gin --gin_file=configs/multi_turn_math.gin`). Leave room for the
extra turns in EngineConfig.max_seq_len.

One episode per sample (RLVRConfig.n_samples per prompt, the group GRPO-style norms see), one
sequence per episode:

    prompt | answer 1 | end of turn + feedback turn | answer 2 | ... | answer k

Each answer is sampled by the engine (RLVRConfig.sampling) with the whole context so far as its
prompt, and scored by RLVRConfig.reward against the row's gold answer. A correct answer (reward
> 0) or the last turn ends the episode; otherwise the turn is closed as the chat template closes
an assistant turn, the feedback is appended as a user turn (rendered by the chat template with the
same variables as the prompts, DataConfig.chat_template_kwargs; plain text under
DataConfig.prompt_template or for a tokenizer without a chat template) and the model answers
again. An episode also ends when the next context would not fit EngineConfig.max_prompt_len.

The trajectory's reward is the last answer's reward times turn_discount ** (turns - 1): a right
answer at the first try is worth most. The inserted tokens (turn endings, feedback) have loss
mask 0, behaviour log-prob 0 and version -1: they are context the model reads, not tokens it
sampled, so they are neither trained nor counted as generated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from areal_jax.data.examples import PromptExample, prompt_example
from areal_jax.api import Trajectory, TrajectoryGroup
from areal_jax.rollout.workflow import GenerationAborted, RLVRConfig, RolloutClient, RolloutWorkflow, stable_seed
from areal_jax.rollout.filters import equal_rewards_filter

if TYPE_CHECKING:  # the encoder is only handed in (the data package needs grain)
    from areal_jax.data.templating import PromptEncoder

# Stands for an assistant answer while the chat template renders a turn boundary (never sampled).
_ANSWER = "\u2063answer\u2063"


@dataclasses.dataclass(frozen=True)
class MultiTurnMathConfig:
    """The multi-turn math workflow (RLConfig.workflow = "areal_jax.workflows.multi_turn_math:MultiTurnMathWorkflow").

    max_turns: tries per episode (1 = single-turn RLVR with one sample per episode).
    turn_discount: the reward of the answer at try t (from 0) is multiplied by turn_discount ** t.
    feedback: the user turn appended after a wrong answer.
    """

    max_turns: int = 2
    turn_discount: float = 0.9
    feedback: str = ("Your answer is wrong. Read the question again, check each step, and give the final answer "
                     "in \\boxed{}.")

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"MultiTurnMathConfig.max_turns must be an int >= 1, got {self.max_turns!r}")
        if not (isinstance(self.turn_discount, (int, float)) and 0 < self.turn_discount <= 1):
            raise ValueError(f"MultiTurnMathConfig.turn_discount must be in (0, 1], got {self.turn_discount!r}")
        if not isinstance(self.feedback, str) or not self.feedback.strip():
            raise ValueError("MultiTurnMathConfig.feedback must be a non-empty string")


def turn_tokens(tokenizer: Any, feedback: str,
                prompt_encoder: PromptEncoder | None = None) -> tuple[list[int], list[int]]:
    """(turn end, feedback turn) token ids as the tokenizer's chat template writes them.

    The turn end is what the template puts after an assistant answer (e.g. "<|im_end|>\\n"); the
    feedback turn is the user message and the opening of the next assistant turn. Both are read
    off one rendered conversation, so they are exactly what the template would produce there.

    prompt_encoder: the encoder the run's prompts were rendered with (DataConfig.prompt_encoder):
    the template gets its chat_template_kwargs too (Qwen3's enable_thinking=False opens every
    assistant turn with an empty think block, the retries' as well), and when it uses
    DataConfig.prompt_template instead of the chat template the turns are plain text. None: the
    tokenizer's chat template without variables.
    Plain text (no chat template): no turn end, and the feedback on its own lines.
    """
    if prompt_encoder is None:
        chat, kwargs = tokenizer.chat_template is not None, {}
    else:
        chat, kwargs = prompt_encoder.uses_chat_template, prompt_encoder.chat_template_kwargs
    if not chat:
        return [], tokenizer.encode(f"\n\n{feedback}\n\n", add_special_tokens=False)
    question = {"role": "user", "content": "?"}
    answered = tokenizer.apply_chat_template([question, {"role": "assistant", "content": _ANSWER}], tokenize=False,
                                             **kwargs)
    retried = tokenizer.apply_chat_template([question, {"role": "assistant", "content": _ANSWER},
                                             {"role": "user", "content": feedback}], add_generation_prompt=True,
                                            tokenize=False, **kwargs)
    end = answered[answered.rindex(_ANSWER) + len(_ANSWER):]
    after = retried[retried.rindex(_ANSWER) + len(_ANSWER):]
    if not after.startswith(end) or feedback not in after:
        raise ValueError(f"{getattr(tokenizer, 'name', 'the tokenizer')}: its chat template does not render a user "
                         "turn after an assistant turn, so MultiTurnMathWorkflow cannot append feedback")
    return (tokenizer.encode(end, add_special_tokens=False),
            tokenizer.encode(after[len(end):], add_special_tokens=False))


@dataclasses.dataclass
class Episode:
    """One sample's turns, as they accumulate (completion-aligned arrays)."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    turns: int = 0
    # MoE: the engine's record `[P + len(tokens), L_moe, k]` of the whole sequence (Completion.moe_routing).
    moe_routing: np.ndarray | None = None

    def add_generated(self, tokens, logprobs, versions, moe_routing: np.ndarray | None = None) -> None:
        """A turn's answer; `moe_routing` `[context + G, L_moe, k]`: its request's record. Tokens fed
        in by an earlier turn keep that turn's rows (the routing their successors were sampled
        under, as across a weight swap); this turn adds the rows of the tokens it fed in first: the
        previous answer's last token, the inserted turn and its own answer."""
        if moe_routing is not None:
            kept = self.moe_routing[:-1] if self.moe_routing is not None else moe_routing[:0]  # the last row: unfed
            self.moe_routing = np.concatenate([kept, moe_routing[len(kept):]])
        self.tokens += [int(t) for t in tokens]
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]
        self.loss_mask += [1] * len(tokens)
        self.turns += 1

    def add_inserted(self, tokens) -> None:
        self.tokens += [int(t) for t in tokens]
        self.logprobs += [0.0] * len(tokens)
        self.versions += [-1] * len(tokens)
        self.loss_mask += [0] * len(tokens)

    def trajectory(self, prompt: np.ndarray, reward: float, stop_reason: str) -> Trajectory:
        return Trajectory(prompt_ids=prompt, completion_ids=np.asarray(self.tokens, np.int32),
                          behavior_logprobs=np.asarray(self.logprobs, np.float32),
                          versions=np.asarray(self.versions, np.int32), reward=reward, stop_reason=stop_reason,
                          loss_mask=np.asarray(self.loss_mask, np.float32), moe_routing=self.moe_routing)


def discounted(reward: float, turns: int, discount: float) -> float:
    """The episode's reward: its last answer's, times discount per retry."""
    return float(reward) * discount ** (turns - 1)


class MultiTurnMathWorkflow(RolloutWorkflow):
    """RLVRConfig.n_samples episodes per prompt, each up to MultiTurnMathConfig.max_turns tries.

    prompt_encoder: the one the rows' prompts were rendered with (`make_workflow` passes the run's),
    so the inserted turns are rendered as the prompts are (see `turn_tokens`).
    """

    config_class = MultiTurnMathConfig

    def __init__(self, rollout: RLVRConfig, tokenizer: Any, config: MultiTurnMathConfig = MultiTurnMathConfig(),
                 *, prompt_encoder: PromptEncoder | None = None):
        if not isinstance(rollout, RLVRConfig):
            raise TypeError(f"MultiTurnMathWorkflow takes an RLVRConfig, got {type(rollout).__name__}")
        self.rollout, self.config = rollout, config
        self.turn_end, self.feedback_ids = turn_tokens(tokenizer, config.feedback, prompt_encoder)

    async def arun(self, engine_client: RolloutClient, row: Any, *, version: int) -> TrajectoryGroup | None:
        example = prompt_example(row)
        t0 = time.perf_counter()
        query_id = example.query_id
        results = await asyncio.gather(*(
            self._episode(engine_client, example, stable_seed(query_id, version, sample))
            for sample in range(self.rollout.n_samples)), return_exceptions=True)
        for r in results:  # every episode waited for, so no failure is left unobserved
            if isinstance(r, BaseException):
                raise r
        turns = [episode.turns for episode, _ in results]
        return TrajectoryGroup(query_id=query_id, trajectories=tuple(t for _, t in results), admitted_version=version,
                               info={"source": example.source, "task": example.row.task, "turns": turns,
                                     "episode_s": time.perf_counter() - t0})

    async def _episode(self, client: RolloutClient, example: PromptExample, seed: int) -> tuple[Episode, Trajectory]:
        cfg, rollout = self.config, self.rollout
        limit = client.engine.config.prompt_limit
        prompt, gold = example.prompt_ids, example.gold
        episode = Episode()
        context = prompt
        while True:
            # One seed per (episode, turn): reproducible however the engine batches requests.
            result = await client.generate(context, rollout.sampling, 1, seed=stable_seed(seed, episode.turns))
            (answer,) = result.completions
            if answer.stop_reason == "aborted":
                raise GenerationAborted(f"generation for {example.source} was aborted")
            episode.add_generated(answer.tokens, answer.logprobs, answer.versions, answer.moe_routing)
            reward = await client.reward(rollout.reward, client.decode(answer.tokens), gold,
                                         timeout_s=rollout.reward_timeout_s)
            if reward > 0 or episode.turns == cfg.max_turns:
                break
            # A stopped answer already ends with the template's first end-of-turn token (its eos).
            end = self.turn_end
            if end and answer.stop_reason == "stop" and len(answer.tokens) and int(answer.tokens[-1]) == end[0]:
                end = end[1:]
            inserted = [*end, *self.feedback_ids]
            if len(prompt) + len(episode.tokens) + len(inserted) > limit:
                break  # no room to ask again
            episode.add_inserted(inserted)
            context = np.concatenate([prompt, np.asarray(episode.tokens, np.int32)])
        trajectory = episode.trajectory(prompt, discounted(reward, episode.turns, cfg.turn_discount),
                                        answer.stop_reason)
        return episode, trajectory

    def reject_reason(self, group: TrajectoryGroup) -> str | None:
        return equal_rewards_filter(group) if self.rollout.filter_all_equal_rewards else None
