"""Custom workflows: the contract checked on load, and the multi-turn math example's episodes
(feedback tokens masked out of the loss, reward discounted per turn) against hand-built ones."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

import areal_jax.tasks  # noqa: F401  (registers the "arithmetic" reward)
from areal_jax.data import DataConfig
from areal_jax.generation.engine import Completion, GroupResult
from areal_jax.metrics import batch_metrics
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.rollout.types import Trajectory, TrajectoryGroup
from areal_jax.rollout.workflow import RLVRConfig, RolloutClient, RolloutWorkflow, make_workflow, resolve_workflow_class
from areal_jax.tasks import arithmetic as ar
from areal_jax.tasks.tokenizer_builder import build_tokenizer
from areal_jax.workflows.multi_turn_math import MultiTurnMathConfig, MultiTurnMathWorkflow, turn_tokens
from tests.tokenizer_fixtures import build_tiny_tokenizer

PATH = "areal_jax.workflows.multi_turn_math:MultiTurnMathWorkflow"
FEEDBACK = "Wrong, retry."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


class ScriptedClient(RolloutClient):
    """The real client (in-process arithmetic reward, the tokenizer's decode) whose generations are
    scripted answers, so a test decides which tries are right. Records every prompt it is given."""

    def __init__(self, tokenizer: Tokenizer, answers: list[tuple[str, str]], prompt_limit: int = 500):
        engine = types.SimpleNamespace(config=types.SimpleNamespace(prompt_limit=prompt_limit))
        super().__init__(engine, tokenizer)
        self.answers, self.prompts = list(answers), []

    async def generate(self, prompt_ids, sampling, n=1, *, seed=None) -> GroupResult:
        assert n == 1
        self.prompts.append(np.asarray(prompt_ids).tolist())
        text, stop_reason = self.answers.pop(0)
        tokens = np.asarray(self.tokenizer.encode(text, add_special_tokens=False), np.int32)
        turn = len(self.prompts)  # distinct log-probs and versions per turn, to follow them
        return GroupResult("r", np.asarray(prompt_ids), [Completion(
            tokens, np.full(tokens.size, -0.1 * turn, np.float32), np.full(tokens.size, turn, np.int32),
            stop_reason)])


def _episode(tokenizer, answers, *, max_turns=3, discount=0.5, prompt_limit=500):
    workflow = MultiTurnMathWorkflow(RLVRConfig(n_samples=1, reward="arithmetic"), tokenizer,
                                     MultiTurnMathConfig(max_turns=max_turns, turn_discount=discount,
                                                         feedback=FEEDBACK))
    row = next(ar.prompt_rows(tokenizer, [ar.make_problem("2+3")]))  # gold answer 5
    client = ScriptedClient(tokenizer, answers, prompt_limit)
    try:
        group = asyncio.run(workflow.arun(client, row, version=7))
    finally:
        client.close()
    (trajectory,) = group.trajectories
    return row, client, group, trajectory


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_wrong_answers_get_feedback_masked_out_and_the_reward_discounted(tokenizer):
    a0, a1 = "2+3=6\n\\boxed{6}<|end|>", "2+3=5\n\\boxed{5}<|end|>"
    row, client, group, t = _episode(tokenizer, [(a0, "stop"), (a1, "stop")])
    prompt = row["prompt_ids"].tolist()
    # The built-in template ends a turn with <|end|> (the answer's own eos): only the user turn and
    # the next assistant opening are inserted.
    inserted = _ids(tokenizer, f"<|user|>{FEEDBACK}<|end|><|assistant|>")
    n0, n1 = len(_ids(tokenizer, a0)), len(_ids(tokenizer, a1))
    assert t.completion_ids.tolist() == _ids(tokenizer, a0) + inserted + _ids(tokenizer, a1)
    assert t.loss_mask.tolist() == [1] * n0 + [0] * len(inserted) + [1] * n1
    assert t.versions.tolist() == [1] * n0 + [-1] * len(inserted) + [2] * n1
    np.testing.assert_allclose(t.behavior_logprobs, [-0.1] * n0 + [0.0] * len(inserted) + [-0.2] * n1)
    # The second try saw the whole first exchange as its prompt.
    assert client.prompts == [prompt, prompt + _ids(tokenizer, a0) + inserted]
    assert t.reward == 1.0 * 0.5 ** 1 and t.stop_reason == "stop"
    assert t.generated_tokens == n0 + n1 and group.info["turns"] == [2] and group.admitted_version == 7
    # In the trainer's row the inserted tokens are neither trained nor carry a version.
    row_arrays = t.training_row()
    P = len(prompt)
    assert row_arrays["loss_mask"][P - 1:].tolist() == t.loss_mask.tolist() + [0.0]
    assert row_arrays["versions"][P - 1:-1].tolist() == t.versions.tolist()
    assert group.oldest_version == 1


def test_every_try_wrong_uses_all_turns_and_a_truncated_answer_is_closed(tokenizer):
    cut, wrong = "2+3=", "\\boxed{4}<|end|>"
    _, client, group, t = _episode(tokenizer, [(cut, "length"), (wrong, "stop"), (wrong, "stop")], discount=0.8)
    # A truncated answer has no <|end|> of its own: the inserted tokens close its turn first.
    closed = _ids(tokenizer, f"<|end|><|user|>{FEEDBACK}<|end|><|assistant|>")
    inserted = _ids(tokenizer, f"<|user|>{FEEDBACK}<|end|><|assistant|>")
    assert t.completion_ids.tolist() == _ids(tokenizer, cut) + closed + _ids(tokenizer, wrong) + inserted + \
        _ids(tokenizer, wrong)
    assert t.loss_mask.tolist() == ([1] * len(_ids(tokenizer, cut)) + [0] * len(closed) + [1] * len(
        _ids(tokenizer, wrong)) + [0] * len(inserted) + [1] * len(_ids(tokenizer, wrong)))
    assert len(client.prompts) == 3 and group.info["turns"] == [3]
    assert t.reward == 0.0


def test_right_first_try_is_single_turn_and_undiscounted(tokenizer):
    answer = "\\boxed{5}<|end|>"
    _, client, group, t = _episode(tokenizer, [(answer, "stop")])
    assert t.completion_ids.tolist() == _ids(tokenizer, answer) and t.loss_mask.tolist() == [1] * len(t.loss_mask)
    assert t.reward == 1.0 and len(client.prompts) == 1


def test_no_retry_when_the_next_context_would_not_fit(tokenizer):
    a0 = "\\boxed{6}<|end|>"
    row = next(ar.prompt_rows(tokenizer, [ar.make_problem("2+3")]))
    inserted = _ids(tokenizer, f"<|user|>{FEEDBACK}<|end|><|assistant|>")
    fits = len(row["prompt_ids"]) + len(_ids(tokenizer, a0)) + len(inserted)
    _, client, _, t = _episode(tokenizer, [(a0, "stop")], prompt_limit=fits - 1)
    assert len(client.prompts) == 1 and t.reward == 0.0 and t.loss_mask.tolist() == [1] * len(_ids(tokenizer, a0))
    _, client, _, _ = _episode(tokenizer, [(a0, "stop"), (a0, "stop"), (a0, "stop")], prompt_limit=fits)
    assert len(client.prompts) == 2  # the second context is exactly `fits` long; a third would not fit


def test_turn_tokens_follow_the_chat_template(tmp_path):
    chatml = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "chatml", "chatml"))
    end, feedback = turn_tokens(chatml, FEEDBACK)
    assert chatml.decode(end) == "<|im_end|>\n"
    assert chatml.decode(feedback) == f"<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n"
    plain = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "plain", "chatml", template_storage="none"))
    end, feedback = turn_tokens(plain, FEEDBACK)
    assert end == [] and plain.decode(feedback) == f"\n\n{FEEDBACK}\n\n"


# ChatML whose assistant turns open with an empty think block when enable_thinking is False, in the
# generation prompt (as Qwen3's template does) and in the conversation's earlier assistant turns (so,
# unlike Qwen3's, a conversation's rendering continues the rendering of each of its prefixes).
THINKING_TEMPLATE = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.role == 'assistant' and enable_thinking is defined and not enable_thinking %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
    {{- message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
EMPTY_THINK = "<think>\n\n</think>\n\n"
NO_THINKING = {"enable_thinking": False}


def _chat_tokenizer(directory, style: str) -> Tokenizer:
    """"qwen3" (the Qwen3-style fixture) or "thinking" (ChatML ids with THINKING_TEMPLATE)."""
    if style == "qwen3":
        return Tokenizer.from_pretrained(build_tiny_tokenizer(directory, "qwen3"))
    out = build_tiny_tokenizer(directory, "chatml", template_storage="none")
    (out / "chat_template.jinja").write_text(THINKING_TEMPLATE, encoding="utf-8")
    return Tokenizer.from_pretrained(out)


def _encoder(tokenizer, **data):
    return DataConfig(paths=("unused.jsonl",), **data).prompt_encoder(tokenizer)


@pytest.mark.parametrize("style", ["qwen3", "thinking"])
def test_turn_tokens_use_the_prompts_chat_template_kwargs(tmp_path, style):
    tok = _chat_tokenizer(tmp_path, style)
    answer = "2+3=6"
    conversation = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": FEEDBACK}]

    def after_the_answer(**kwargs):  # the whole conversation's rendering, from the end of the first answer
        text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)
        return _ids(tok, text[text.index(answer) + len(answer):])

    end, feedback = turn_tokens(tok, FEEDBACK, _encoder(tok, chat_template_kwargs=NO_THINKING))
    assert tok.decode(end) == "<|im_end|>\n"
    assert tok.decode(feedback) == f"<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n{EMPTY_THINK}"
    assert end + feedback == after_the_answer(**NO_THINKING)
    # A run that sets no variable (and the workflow built without an encoder): no think block.
    for encoder in (_encoder(tok), None):
        plain_end, plain_feedback = turn_tokens(tok, FEEDBACK, encoder)
        assert plain_end == end and "<think>" not in tok.decode(plain_feedback)
        assert plain_end + plain_feedback == after_the_answer()
    # The workflow renders its turns with the encoder make_workflow hands it.
    workflow = make_workflow(resolve_workflow_class(PATH), RLVRConfig(), tok, MultiTurnMathConfig(feedback=FEEDBACK),
                             prompt_encoder=_encoder(tok, chat_template_kwargs=NO_THINKING))
    assert (workflow.turn_end, workflow.feedback_ids) == (end, feedback)


def test_turn_tokens_are_plain_text_under_a_prompt_template(tmp_path):
    """DataConfig.prompt_template renders the prompts without the chat template: the feedback too,
    even for a tokenizer that has one."""
    chatml = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "chatml"))
    end, feedback = turn_tokens(chatml, FEEDBACK, _encoder(chatml, prompt_template="Question: {question}\nAnswer:"))
    assert end == [] and chatml.decode(feedback) == f"\n\n{FEEDBACK}\n\n"


class TwoArgumentWorkflow(RolloutWorkflow):
    """A workflow written against the contract before prompt_encoder: (rollout, tokenizer)."""

    def __init__(self, rollout, tokenizer):
        self.rollout, self.tokenizer = rollout, tokenizer

    async def arun(self, engine_client, row, *, version):
        return None


def test_make_workflow_passes_the_prompt_encoder_only_to_constructors_that_take_it(tokenizer):
    encoder = _encoder(tokenizer)
    workflow = make_workflow(resolve_workflow_class("tests.test_workflows:TwoArgumentWorkflow"), RLVRConfig(),
                             tokenizer, prompt_encoder=encoder)
    assert isinstance(workflow, TwoArgumentWorkflow) and workflow.tokenizer is tokenizer


def test_an_episode_is_the_chat_templates_rendering_of_its_conversation(tmp_path):
    """From the job's configs (a dataset whose DataConfig sets a template variable) to one episode:
    the loader's prompt, the sampled answers and the inserted turns together are exactly the chat
    template's rendering of the conversation with that variable."""
    from areal_jax.data import build_prompt_loader
    from areal_jax.jobs.train import _rollout_workflow

    tok = _chat_tokenizer(tmp_path / "tok", "thinking")
    path = ar.write_jsonl(tmp_path / "rows.jsonl", "test", 1, seed=5)
    cfg = _load('TaskSource.kind = "dataset"', "TaskSource.eval_size = 0", "Stages.sft = False",
                f'DataConfig.paths = ["{path}"]', "DataConfig.chat_template_kwargs = {'enable_thinking': False}",
                f'RLConfig.workflow = "{PATH}"', "MultiTurnMathConfig.max_turns = 3",
                f'MultiTurnMathConfig.feedback = "{FEEDBACK}"')
    workflow = _rollout_workflow(cfg, RLVRConfig(n_samples=1, reward="arithmetic"), tok)  # as `areal-jax train`
    row = next(iter(build_prompt_loader(cfg.data, tok)))
    gold = int(row["row"].answer)
    # Truncated (its turn closed by the inserted tokens), wrong (stopped at its own <|im_end|>), right.
    answers = [f"{gold} - 1 =", f"\\boxed{{{gold + 1}}}", f"\\boxed{{{gold}}}"]
    client = ScriptedClient(tok, [(answers[0], "length"), (answers[1] + "<|im_end|>", "stop"),
                                  (answers[2] + "<|im_end|>", "stop")])
    try:
        (t,) = asyncio.run(workflow.arun(client, row, version=0)).trajectories
    finally:
        client.close()
    assert t.reward == 0.9 ** 2 and t.generated_tokens == sum(len(_ids(tok, a)) + 1 for a in answers) - 1
    conversation = list(row["row"].messages)
    for i, answer in enumerate(answers):
        conversation += [{"role": "assistant", "content": answer}] + ([{"role": "user", "content": FEEDBACK}] * (i < 2))
    rendered = tok.apply_chat_template(conversation, tokenize=False, **NO_THINKING)
    assert rendered.count(EMPTY_THINK) == 3 and rendered.endswith("<|im_end|>\n")
    episode = t.prompt_ids.tolist() + t.completion_ids.tolist()
    assert episode == _ids(tok, rendered.removesuffix("\n"))  # the episode ends at the last answer's eos
    assert episode != _ids(tok, tok.apply_chat_template(conversation, tokenize=False).removesuffix("\n"))


def test_batch_metrics_against_hand_computed_values():
    def traj(reward, n_generated, n_inserted, stop):
        g = n_generated + n_inserted
        mask = np.array([1] * n_generated + [0] * n_inserted, np.float32)
        return Trajectory(np.array([1, 2]), np.arange(g), np.zeros(g), np.where(mask > 0, 0, -1), reward, stop, mask)

    groups = [TrajectoryGroup("a", (traj(1.0, 4, 3, "stop"), traj(0.0, 6, 0, "length")), 0),
              TrajectoryGroup("b", (traj(0.45, 2, 5, "stop"), traj(0.0, 8, 0, "length")), 0)]
    m = batch_metrics(t for g in groups for t in g.trajectories)
    rewards = [1.0, 0.0, 0.45, 0.0]
    mean = sum(rewards) / 4  # 0.3625
    assert m["reward/mean"] == pytest.approx(0.3625) == pytest.approx(mean)
    assert m["reward/std"] == pytest.approx((sum((r - mean) ** 2 for r in rewards) / 4) ** 0.5)
    assert m["reward/accuracy"] == 0.25
    assert m["completion/mean_length"] == (4 + 6 + 2 + 8) / 4 and m["completion/max_length"] == 8
    assert m["completion/truncated_frac"] == 0.5


def test_trajectory_loss_mask_is_checked():
    with pytest.raises(ValueError, match="loss_mask"):
        Trajectory(np.array([1]), np.arange(3), np.zeros(3), np.zeros(3), 0.0, loss_mask=np.ones(2))
    with pytest.raises(ValueError, match="loss_mask"):
        Trajectory(np.array([1]), np.arange(2), np.zeros(2), np.zeros(2), 0.0, loss_mask=np.array([1, 2]))


class NoArun:
    def run(self):
        pass


class SyncArun:
    def arun(self, client, row, *, version):
        return None


class BadConfigClass(MultiTurnMathWorkflow):
    config_class = dict


@pytest.mark.parametrize("path, message", [
    ("areal_jax.workflows.multi_turn_math.MultiTurnMathWorkflow", "not of the form 'package.module:Class'"),
    ("areal_jax.no_such_module:Flow", "cannot import module 'areal_jax.no_such_module'"),
    ("areal_jax.workflows.multi_turn_math:Missing", "has no attribute 'Missing'"),
    ("areal_jax.workflows.multi_turn_math:discounted", "is not a class"),
    ("tests.test_workflows:NoArun", "not a workflow: the class has no `async def arun"),
    ("tests.test_workflows:SyncArun", "not a workflow"),
    ("tests.test_workflows:BadConfigClass", "config_class must be a dataclass"),
])
def test_resolve_workflow_class_names_the_field_and_the_problem(path, message):
    with pytest.raises(ValueError) as info:
        resolve_workflow_class(path)
    text = str(info.value)
    assert text.startswith(f"RLConfig.workflow = {path!r}: ") and message in text and "\n" not in text


def test_make_workflow_passes_the_config(tokenizer):
    cls = resolve_workflow_class(PATH)
    workflow = make_workflow(cls, RLVRConfig(reward="arithmetic"), tokenizer, MultiTurnMathConfig(max_turns=4))
    assert isinstance(workflow, MultiTurnMathWorkflow) and workflow.config.max_turns == 4
    with pytest.raises(TypeError, match="MultiTurnMathConfig"):
        make_workflow(cls, RLVRConfig(), tokenizer, None)
    with pytest.raises(ValueError, match="max_turns"):
        MultiTurnMathConfig(max_turns=0)
    with pytest.raises(ValueError, match="turn_discount"):
        MultiTurnMathConfig(turn_discount=1.5)


# ---- end to end: `areal-jax train` with the workflow named on the command line ---------------------


def test_multi_turn_workflow_trains_from_the_command_line_with_wandb_offline(tmp_path):
    """A short quickstart run whose rollouts are multi-turn episodes, logged to an offline W&B run."""
    from areal_jax.cli import main
    from areal_jax.jobs.progress import progress_series
    from areal_jax.metrics import flatten_metrics, read_jsonl
    from tests.test_cli import QUICKSTART, SHORT, SPLIT_8
    from tests.wandb_records import finished_runs

    extra = [f'RLConfig.workflow = "{PATH}"', "MultiTurnMathConfig.max_turns = 2",
             "MultiTurnMathConfig.turn_discount = 0.5", f'MultiTurnMathConfig.feedback = "{FEEDBACK}"',
             "RLConfig.dump_rollouts_every = 1", "MetricsConfig.wandb_mode = 'offline'",
             "MetricsConfig.wandb_run_name = 'multi-turn'", "MetricsConfig.wandb_tags = ['test']", SPLIT_8]
    args = ["train", f"--gin_file={QUICKSTART}", *[f"--gin_param={p}" for p in SHORT + extra],
            f"--run_dir={tmp_path}", "--quiet"]
    assert main(args) == 0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    rl = [r for r in records if "reward/mean" in flatten_metrics(r["metrics"])]
    assert [r["step"] for r in rl] == [0, 1]
    tokenizer = Tokenizer.from_pretrained(tmp_path / "final_model")
    inserted = _ids(tokenizer, f"<|user|>{FEEDBACK}<|end|><|assistant|>")
    retried = 0
    for r in rl:
        m = flatten_metrics(r["metrics"])
        dumped = read_jsonl(tmp_path / "rollouts" / f"step_{r['step']}.jsonl")
        assert len(dumped) == 2 * 2  # RLConfig.batch_size x RLVRConfig.n_samples episodes
        for d in dumped:
            unmasked = d["loss_mask"].count(0)
            # At most one feedback turn (+1: the <|end|> closing a truncated first answer).
            assert unmasked in (0, len(inserted), len(inserted) + 1)
            assert d["completion"].count(f"<|end|><|user|>{FEEDBACK}<|end|><|assistant|>") == (unmasked > 0)
            # Discounted: right at the first try 1, at the second 0.5, never right 0.
            assert d["reward"] in ((1.0, 0.0) if not unmasked else (0.5, 0.0))
            retried += unmasked > 0
        # The step's metrics are those of its trajectories (lengths count generated tokens only).
        rewards = [d["reward"] for d in dumped]
        generated = [d["loss_mask"].count(1) for d in dumped]
        assert m["reward/mean"] == pytest.approx(np.mean(rewards))
        assert m["reward/std"] == pytest.approx(np.std(rewards))
        assert m["completion/mean_length"] == pytest.approx(np.mean(generated))
        assert m["completion/max_length"] == max(generated)
        assert m["completion/truncated_frac"] == pytest.approx(np.mean([d["stop_reason"] == "length" for d in dumped]))
    assert retried > 0  # a 10-step SFT policy gets most problems wrong: feedback turns happened
    # progress.png draws the steps of metrics.jsonl (and so of TensorBoard and W&B).
    assert progress_series([r["metrics"] for r in rl])[0] == [r["step"] for r in rl]
    (run,) = finished_runs(tmp_path, 1)
    assert run["run"]["name"] == "multi-turn" and run["run"]["tags"] == ["test"]
    assert run["config"]["rl"]["workflow"] == PATH and run["config"]["workflow_config"]["max_turns"] == 2
    logged = [h for h in run["history"] if "reward/mean" in h]
    assert [h["step"] for h in logged] == [r["step"] for r in rl]
    for h, r in zip(logged, rl):
        m = flatten_metrics(r["metrics"])
        assert all(h[k] == pytest.approx(m[k]) for k in ("reward/mean", "reward/std", "completion/truncated_frac"))


# ---- the workflow and its config from gin, checked before any work ---------------------------------


def _load(*params):
    from areal_jax.jobs.configs import load_job_configs

    return load_job_configs(gin_params=["TrainEngineConfig.max_tokens_per_microbatch = 4096", *params], run_dir="unused")


def test_workflow_config_binds_from_gin_without_an_import_line():
    cfg = _load(f'RLConfig.workflow = "{PATH}"', "MultiTurnMathConfig.max_turns = 3",
                "MultiTurnMathConfig.turn_discount = 0.25")
    assert cfg.workflow_config == MultiTurnMathConfig(max_turns=3, turn_discount=0.25)
    assert _load().workflow_config is None  # the default RLVR workflow has no config of its own


@pytest.mark.parametrize("params, message", [
    (['RLConfig.workflow = "areal_jax.nope:Flow"'], "RLConfig.workflow = 'areal_jax.nope:Flow': cannot import"),
    ([f'RLConfig.workflow = "{PATH}"', "MultiTurnMathConfig.max_turns = 0"], "MultiTurnMathConfig.max_turns"),
    ([f'RLConfig.workflow = "{PATH}"', "MultiTurnMathConfig.max_turn = 3"], "max_turn"),
    ([f'RLConfig.workflow = "{PATH}"', "NoSuchConfig.x = 1"], "NoSuchConfig"),
    (["MultiTurnMathConfig.max_turns = 3"], "MultiTurnMathConfig"),  # bound, but no workflow uses it
    ([f'RLConfig.workflow = "{PATH}"', "TrainEngineConfig.max_tokens_per_microbatch = 64", "EngineConfig.max_seq_len = 96"],
     "TrainEngineConfig.max_tokens_per_microbatch (64) is below EngineConfig.max_seq_len (96)"),
])
def test_workflow_problems_are_configuration_errors_naming_the_field(params, message):
    from areal_jax.config_system import ConfigError

    with pytest.raises(ConfigError) as info:
        _load(*params)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_shipped_multi_turn_config_loads_on_top_of_the_quickstart(tmp_path):
    from areal_jax.jobs.configs import load_job_configs
    from tests.test_cli import QUICKSTART, ROOT

    cfg = load_job_configs([QUICKSTART, ROOT / "configs" / "multi_turn_math.gin"], run_dir=str(tmp_path))
    assert cfg.rl.workflow == PATH and cfg.workflow_config.max_turns == 2 and cfg.engine.max_seq_len == 192
    # The two tries of a quickstart problem fit the engine's prompt limit with the shipped feedback.
    tokenizer = Tokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    row = next(ar.prompt_rows(tokenizer, [ar.make_problem("9-8+7-6")]))
    _, feedback = turn_tokens(tokenizer, cfg.workflow_config.feedback)
    assert len(row["prompt_ids"]) + 2 * cfg.rollout.max_new_tokens + len(feedback) <= cfg.engine.prompt_limit
