"""docs/user_guide.md "Learned rewards", as written: its Python example runs, and a run whose
reward is the guide's kind of composite (a verifier at weight 0, a reward model, a judge) trains
from the command line and logs each term's mean and failures per step."""

import subprocess
import sys

import pytest

from areal_jax.metrics import read_jsonl
from tests.learned_reward_fixtures import build_rm_and_judge
from tests.test_user_code import ROOT, areal_jax, guide_example, train_args


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    _, rm_dir, judge_dir = build_rm_and_judge(tmp_path_factory.mktemp("guide"))
    return rm_dir, judge_dir


def test_the_guides_python_example_runs(dirs, tmp_path):
    rm_dir, judge_dir = dirs
    script = tmp_path / "learned_rewards.py"
    script.write_text(guide_example("learned_rewards.py"))
    done = subprocess.run([sys.executable, str(script), str(rm_dir), str(judge_dir)], capture_output=True, text=True,
                          timeout=600, env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3 and lines[2].startswith("[Verdict(score=") and "failed=None" in lines[2]


@pytest.mark.slow  # a CLI run (~1.5 min on a loaded 2-core host); test_reward_composite covers the parts
def test_a_composite_reward_trains_and_logs_each_term(dirs, tmp_path):
    rm_dir, judge_dir = dirs
    run = tmp_path / "run"
    done = areal_jax(*train_args(run, f"RLVRConfig.reward = (('arithmetic', 0.0), ('rm:{rm_dir}', 0.5), ('judge', 0.5))",
                                 f"JudgeConfig.model = '{judge_dir}'", "JudgeConfig.parse = 'logprob'",
                                 "JudgeConfig.choices = ('Yes', 'No')"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for r in (record["metrics"] for record in records):
        for term in ("arithmetic", f"rm:{rm_dir}", "judge"):
            assert r[f"reward/{term}/failed"] == 0
            assert r[f"reward/{term}/mean"] == r[f"reward/{term}/mean"]  # a number, not NaN
        # The trained reward is the weighted sum of the terms (the verifier's weight is 0).
        assert r["reward/mean"] == pytest.approx(0.5 * r[f"reward/rm:{rm_dir}/mean"] + 0.5 * r["reward/judge/mean"],
                                                 abs=1e-4)
        assert 0.0 <= r["reward/judge/mean"] <= 1.0


def test_the_guides_example_commands_name_the_scripts_and_their_flags():
    """The section's commands run the examples tests/test_example_scripts.py runs; each names a
    script there and flags its parser takes (the runs themselves are those tests)."""
    import re
    import runpy

    guide = (ROOT / "docs" / "user_guide.md").read_text()
    section = guide[guide.index("### Learned rewards"):guide.index("### Your own workflow")]
    commands = re.findall(r"^python (examples/\S+\.py)(.*?)(?:\s+#.*)?$", section, re.M)
    assert {script for script, _ in commands} == {"examples/learned_reward_model.py", "examples/learned_judge.py"}
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        for script, args in commands:
            module = runpy.run_path(str(ROOT / script))
            parsed = module["parse_args"](args.split(), module["__doc__"])
            assert parsed.run_dir.name in ("example_rm", "example_judge")
    finally:
        sys.path.remove(str(ROOT / "examples"))
