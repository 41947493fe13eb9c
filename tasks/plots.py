"""Progress plots of training runs, drawn on the controller from verl's console output.

    python -m tasks.plots --out DIR [NAME=]LOGFILE ...

Per run (a box): score (``critic/score/mean``, with the validation score where verl validated),
mean response length and seconds per step (less the validation verl counts inside a step),
over the steps: ``DIR/<name>.png``. With more than one run, ``DIR/lab.png`` puts every box's
score and seconds per step side by side. Where boxes have GSM8K scores (the base model and the
run's proven export: deploy/status.py's rows, or ``--status-json`` of its JSON), ``DIR/gsm8k.png``
shows base against trained per box. The logs are read by ``tasks.status`` (journal
prefixes, Ray prefixes, colour codes, cut logs). Needs matplotlib (``pip install -e '.[plots]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tasks.status import RESPONSE_LENGTH, SCORE, STEP_SECONDS, TESTING_SECONDS, VALIDATION_PREFIX, RunLog, read_log

PANELS = (("score", "score (critic/score/mean)"), ("response_length", "response length (tokens)"),
          ("seconds_per_step", "seconds per step"))


def series(run: RunLog) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per panel: score, validation (first val-core metric), response length,
    seconds per step less validation."""
    out: dict[str, list[tuple[int, float]]] = {"score": [], "validation": [], "response_length": [],
                                               "seconds_per_step": []}
    for s in run.steps:
        m, n = s["metrics"], s["step"]
        if m.get(SCORE) is not None:
            out["score"].append((n, m[SCORE]))
        val = sorted(k for k in m if k.startswith(VALIDATION_PREFIX) and m[k] is not None)
        if val:
            out["validation"].append((n, m[val[0]]))
        if m.get(RESPONSE_LENGTH) is not None:
            out["response_length"].append((n, m[RESPONSE_LENGTH]))
        if m.get(STEP_SECONDS) is not None:
            out["seconds_per_step"].append((n, m[STEP_SECONDS] - (m.get(TESTING_SECONDS) or 0.0)))
    return out


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib on the controller: pip install -e '.[plots]' (or pip install "
                         "matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _axes(ax, title):
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _line(ax, points, **kw):
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], **kw)


def plot_run(name: str, run: RunLog, out: Path) -> Path:
    plt = _pyplot()
    data = series(run)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(13, 3.6), constrained_layout=True)
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        _line(ax, data[key], marker="o", ms=3, label="training")
        if key == "score":
            _line(ax, data["validation"], marker="s", ls="none", label="validation")
            ax.legend(fontsize=8)
        _axes(ax, title)
    total = f" of {run.total_steps}" if run.total_steps else ""
    fig.suptitle(f"{name}: step {run.steps[-1]['step'] if run.steps else 0}{total}", fontsize=11)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_lab(runs: dict[str, RunLog], out: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    for name, run in runs.items():
        data = series(run)
        _line(axes[0], data["score"], marker="o", ms=3, label=name)
        _line(axes[1], data["seconds_per_step"], marker="o", ms=3, label=name)
    for ax, title in zip(axes, ("score (critic/score/mean)", "seconds per step"), strict=True):
        _axes(ax, title)
        ax.legend(fontsize=8)
    fig.suptitle(f"the lab: {len(runs)} boxes", fontsize=11)
    path = out / "lab.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_gsm8k(scores: dict[str, dict], out: Path) -> Path:
    """Base model against the trained export's GSM8K accuracy, a pair of bars per box
    (``scores``: tasks.status.gsm8k_summary per box)."""
    plt = _pyplot()
    names = list(scores)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(names) + 1.5), 3.6), constrained_layout=True)
    width = 0.38
    for k, (key, label) in enumerate((("base", "base model"), ("trained", "trained (export)"))):
        xs = [i + (k - 0.5) * width for i in range(len(names))]
        values = [scores[n].get(key) for n in names]
        bars = ax.bar(xs, [v or 0.0 for v in values], width, label=label)
        for bar, v in zip(bars, values, strict=True):
            ax.annotate("-" if v is None else f"{v:.3f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ticks = [f"{n}\nstep {scores[n]['step']}{'' if scores[n].get('final') else '?'}" if scores[n].get("step") is not None
             else n for n in names]
    ax.set_xticks(range(len(names)), ticks, fontsize=8)
    ax.set_ylabel("GSM8K test accuracy (greedy)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.suptitle("GSM8K: base -> trained", fontsize=11)
    path = out / "gsm8k.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_all(runs: dict[str, RunLog], out: Path, scores: dict[str, dict] | None = None) -> list[Path]:
    """A figure per run with steps, the lab figure when there is more than one, and the GSM8K figure
    when a box has a score."""
    out.mkdir(parents=True, exist_ok=True)
    with_steps = {name: run for name, run in runs.items() if run.steps}
    made = [plot_run(name, run, out) for name, run in with_steps.items()]
    if len(with_steps) > 1:
        made.append(plot_lab(with_steps, out))
    scored = {name: g for name, g in (scores or {}).items()
              if g and (g.get("base") is not None or g.get("trained") is not None)}
    if scored:
        made.append(plot_gsm8k(scored, out))
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.plots", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the PNG files")
    ap.add_argument("--status-json", type=Path, help="deploy/status.py's JSON (status_json=): its GSM8K scores")
    ap.add_argument("logs", nargs="+", help="[NAME=]LOGFILE: verl's console output of one run (a box)")
    args = ap.parse_args(argv)
    scores = None
    if args.status_json:
        try:
            scores = {h["host"]: h.get("gsm8k") for h in json.loads(args.status_json.read_text())["hosts"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"cannot read GSM8K scores from {args.status_json}: {exc}", file=sys.stderr)
            return 2
    runs = {}
    for spec in args.logs:
        name, sep, path = spec.partition("=")
        path = Path(path if sep else name)
        try:
            runs[name if sep else path.stem] = read_log(path)
        except OSError as exc:
            print(f"cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    empty = [name for name, run in runs.items() if not run.steps]
    for name in empty:
        print(f"{name}: no verl step lines yet: nothing to plot", file=sys.stderr)
    for path in plot_all(runs, args.out, scores):
        print(path)
    return 2 if len(empty) == len(runs) else 0


if __name__ == "__main__":
    sys.exit(main())
