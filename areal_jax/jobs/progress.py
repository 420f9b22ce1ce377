"""The RL stage's progress for people: the console bar and progress.png (reward and held-out
accuracy against RL steps and wall time)."""

from __future__ import annotations

import io
from typing import Any

import jax

from areal_jax import paths


def accuracy_text(accuracy: float | None) -> str:
    return "n/a (no held-out rows)" if accuracy is None else f"{accuracy:.3f}"


def progress_bar(total: int, enabled: bool):
    if not enabled or jax.process_index() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="RL steps", unit="step")


def progress_series(history: list[dict[str, Any]]) -> tuple[list, list, list, list]:
    """What progress.png draws: RL steps (the step index of metrics.jsonl, TensorBoard and W&B), wall
    times, sampled rewards, and (step, wall time, accuracy) of the held-out checks."""
    steps = [m["step"] for m in history]
    wall = [m["time/since_start_s"] for m in history]
    reward = [m.get("rollout/reward_mean", m["reward/mean"]) for m in history]
    evals = [(m["step"], m["time/since_start_s"], m["eval/accuracy"]) for m in history if "eval/accuracy" in m]
    return steps, wall, reward, evals


def plot_progress(history: list[dict[str, Any]], summary: dict[str, Any], path: paths.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, wall, reward, evals = progress_series(history)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, xs, xlabel, col in ((axes[0], steps, "RL step", 0), (axes[1], wall, "wall time (s)", 1)):
        ax.plot(xs, reward, label="sampled reward (all finished groups)", color="tab:blue")
        if evals:
            ax.plot([e[col] for e in evals], [e[2] for e in evals], "o-", label="held-out accuracy (greedy)",
                    color="tab:orange")
        if summary["sft_accuracy"] is not None:
            ax.axhline(summary["sft_accuracy"], ls="--", color="gray", label="held-out accuracy after SFT")
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"areal-jax: held-out accuracy {accuracy_text(summary['sft_accuracy'])} -> "
                 f"{accuracy_text(summary['final_accuracy'])}")
    fig.tight_layout()
    image = io.BytesIO()  # matplotlib writes local files only: the bytes go through paths
    fig.savefig(image, format="png", dpi=100)
    paths.write_whole(path, image.getvalue())
    plt.close(fig)
