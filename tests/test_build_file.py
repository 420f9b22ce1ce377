"""BUILD stays in step with the tree: every module is in a py_library, every test has a py_test,
every example script is in the examples filegroup."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from update_build import _python_files  # noqa: E402  (tracked files: what a clean checkout has)


def _evaluate_build() -> dict[str, dict]:
    """Runs BUILD's Starlark as Python with stub rule functions that record targets."""
    targets: dict[str, dict] = {}

    def rule(kind):
        def record(**kw):
            assert kw["name"] not in targets, f"duplicate target {kw['name']}"
            targets[kw["name"]] = {"kind": kind, **kw}
        return record

    text = "\n".join(line for line in (ROOT / "BUILD").read_text().splitlines() if not line.startswith("load("))
    exec(text, {"py_library": rule("py_library"), "py_test": rule("py_test"), "filegroup": rule("filegroup"),
                "package": lambda **kw: None})
    return targets


def test_every_module_and_test_has_a_target():
    targets = _evaluate_build()
    library_srcs = {s for t in targets.values() if t["kind"] == "py_library" for s in t["srcs"]}
    modules = {str(p.relative_to(ROOT)) for p in _python_files("areal_jax")}
    assert modules - library_srcs == set(), "modules missing from BUILD: run tools/update_build.py"
    assert library_srcs - modules - {s for s in library_srcs if s.startswith("tests/")} == set()
    tests = {str(p.relative_to(ROOT)) for p in _python_files("tests")
             if p.name.startswith("test_") and p.parent == ROOT / "tests"}
    test_srcs = {s for t in targets.values() if t["kind"] == "py_test" for s in t["srcs"]}
    assert tests == test_srcs, "tests missing from (or stale in) BUILD: run tools/update_build.py"
    examples = {str(p.relative_to(ROOT)) for p in _python_files("examples")}
    assert examples == {s for t in targets.values() if t["kind"] == "filegroup" for s in t["srcs"]}
    for t in targets.values():
        for dep in [*t.get("deps", []), *t.get("data", [])]:
            assert dep.lstrip(":") in targets, f"{t['name']} depends on unknown target {dep}"
        for src in t["srcs"]:
            assert (ROOT / src).exists(), f"{t['name']} lists missing file {src}"


def test_build_file_is_generated_output():
    rc = subprocess.run([sys.executable, str(ROOT / "tools" / "update_build.py"), "--check"]).returncode
    assert rc == 0, "BUILD differs from tools/update_build.py output: run it and commit BUILD"
