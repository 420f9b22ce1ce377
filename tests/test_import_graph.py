"""The package's import graph keeps its layering (docs/architecture.md, "Layers and interfaces"):
`areal_jax/api/` imports nothing from areal_jax, no module imports from a higher layer, and the
graph has no circle (issue 38 asked for at most one; the last, simulate.driver <-> tune_run, went
with simulate/command.py).

The graph is read from the source with `ast`, every import counted: module level, inside
functions, and under `if TYPE_CHECKING:` (a type a module names is a dependency of its design even
where it costs nothing at run time). `from areal_jax.x import y` is an edge to `areal_jax.x.y` when
that is a module, else to `areal_jax.x`.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lowest first. A module belongs to the entry with the longest matching prefix; within a layer
# imports go any way (circles are counted separately). Keep in step with docs/architecture.md.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("api", ("areal_jax.api",)),
    ("foundations", ("areal_jax", "areal_jax.models", "areal_jax.kernels", "areal_jax.ppo", "areal_jax.data",
                     "areal_jax.tasks", "areal_jax.answers", "areal_jax.parallel", "areal_jax.packing", "areal_jax.checkpoint",
                     "areal_jax.checkpoint_validation", "areal_jax.metrics", "areal_jax.eval_metrics",
                     "areal_jax.paths", "areal_jax.platforms", "areal_jax.user_code", "areal_jax.config_system",
                     "areal_jax.lazy_exports", "areal_jax.aot")),
    ("engines", ("areal_jax.generation", "areal_jax.trainer.engine_config", "areal_jax.trainer.train_step",
                 "areal_jax.trainer.programs", "areal_jax.trainer.batching", "areal_jax.trainer.prefix_tree",
                 "areal_jax.trainer.optimizer")),
    ("rollout", ("areal_jax.rollout", "areal_jax.reward", "areal_jax.evaluation", "areal_jax.agents",
                 "areal_jax.workflows")),
    ("RL", ("areal_jax.trainer",)),
    ("configs", ("areal_jax.job_config",)),
    ("jobs", ("areal_jax.jobs", "areal_jax.plan", "areal_jax.simulate")),
    ("front ends", ("areal_jax.python_api", "areal_jax.cli")),
)


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted((ROOT / "areal_jax").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the areal_jax modules it imports."""
    mods = modules()

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names if a.name.split(".")[0] == "areal_jax"}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "areal_jax":
                    continue
                for a in node.names:
                    full = f"{source}.{a.name}"
                    targets.add(full if full in mods else owner(source))
        graph[name] = targets - {None, name}
    return graph


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and docs/architecture.md)"
    return best


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_every_kind_of_import():
    """The reader counts what the assertions below rely on: module-level, function-level and
    TYPE_CHECKING imports, and `from package import submodule` as an edge to the submodule."""
    graph = import_graph()
    assert "areal_jax.reward.worker" in graph["areal_jax.reward.guardian"]  # module level
    assert "areal_jax.jobs.configs" in graph["areal_jax.python_api"]  # inside a function
    assert "areal_jax.data.templating" in graph["areal_jax.workflows.multi_turn_math"]  # under TYPE_CHECKING
    assert "areal_jax.lazy_exports" in graph["areal_jax"]  # from areal_jax import lazy_exports


def test_api_imports_nothing_from_the_package():
    graph = import_graph()
    offending = {m: sorted(t) for m, t in graph.items()
                 if layer_of(m) == 0 and any(layer_of(x) != 0 for x in t)}
    assert offending == {}, f"areal_jax/api/ must import nothing from areal_jax: {offending}"


def test_no_import_runs_from_a_lower_layer_up():
    graph = import_graph()
    upward = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
                    for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m))
    assert upward == [], "imports from a lower layer up:\n" + "\n".join(upward)


def test_no_circle():
    found = circles(import_graph())
    assert found == [], f"{len(found)} import circles: {found}"
