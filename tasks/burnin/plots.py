"""A burn-in's figure (``burnin-<host>.png``): its reward per step with each step's standard error and the rise the
test needed, and its seconds per step beside the speed model's (H200 seconds) and the phases verl timed. Drawn on
the controller from the record (deploy/status.py with ``status_plots``); matplotlib as tasks/plots.py needs it.
"""

from __future__ import annotations

from pathlib import Path

from tasks.plots import _axes, _pyplot


def plot_burnin(name: str, record: dict, out: Path) -> Path | None:
    """The figure of ``record`` (burnin.json) in ``out``; None where it has no scored step."""
    steps = [s for s in record.get("steps") or [] if s.get("score") is not None]
    if not steps:
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    xs = [s["step"] for s in steps]
    left.errorbar(xs, [s["score"] for s in steps], yerr=[s.get("se") or 0.0 for s in steps], marker="o", ms=4,
                  capsize=3, label="mean score (+- standard error)")
    reward = record.get("reward") or {}
    if reward.get("first") is not None and reward.get("needed") is not None:
        left.axhline(reward["first"] + reward["needed"], ls="--", color="grey",
                     label=f"step 1 + the rise needed ({reward['needed']:.3f})")
    saved = (record.get("burnin") or {}).get("saved_step")
    if saved:
        left.axvline(saved + 0.5, ls=":", color="black", label=f"saved at {saved}, resumed")
    left.legend(fontsize=8)
    _axes(left, "reward: share of the class's tokens")
    speed = record.get("speed") or {}
    timed = [(s, t) for s, t in (speed.get("step_seconds") or {}).items()]
    if timed:
        right.plot([int(s) for s, _ in timed], [t for _, t in timed], marker="o", ms=4, label="measured")
    model = (speed.get("model_s") or {}).get("step")
    if model:
        right.axhline(model, ls="--", color="grey", label=f"speed model (H200) {model:.1f} s")
    if speed.get("seconds_per_step"):
        right.axhline(speed["seconds_per_step"], ls=":", color="black",
                      label=f"mean of warm steps {speed['seconds_per_step']:.1f} s")
    right.legend(fontsize=8)
    _axes(right, "seconds per step")
    fig.suptitle(f"{name}: burn-in {record.get('state')} ({record.get('started', '?')})", fontsize=11)
    path = out / f"burnin-{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
