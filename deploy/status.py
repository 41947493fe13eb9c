"""How each box is doing: `pyinfra -y inventory/lab.py deploy/status.py` (changes nothing).

One row per box once every box has answered: the stages proven (markers), the env generation,
the training unit's state (never ran, running, crash-looping, failed, finished), step / total,
the latest score (`critic/score/mean`) and validation score, seconds per step, ETA, the GPU
memory peak against the plan's prediction, the GSM8K score of the base model -> the run's proven
export (tasks.facts.export.RunExports), and the doctor's verdict where the unit failed or never
ran (then with what the launcher's preflight says).

    --data status_json=lab-status.json    the rows as JSON, in that file (pyinfra's own output
                                          stays on stdout)
    --data status_plots=plots/            score, response length and s/step per box, and the
                                          lab figure (PNG; needs matplotlib: pip install -e '.[plots]');
                                          each burn-in's reward and step seconds (burnin-<host>.png)

Each box's journal of the current run is kept under the controller cache (status/<host>.log);
`python -m tasks.status` and `python -m tasks.plots` read those files too.
"""

from pathlib import Path

from pyinfra import host, inventory

from tasks.burnin import BURNIN_UNIT, burnin_paths, status_lines
from tasks.doctor import diagnose, never_ran, render
from tasks.driver.stage import held_driver_notes
from tasks.facts.bundle import ask
from tasks.facts.burnin import BurninRecord
from tasks.facts.export import RunExports
from tasks.facts.files import UnitState
from tasks.facts.logs import TrainingRun
from tasks.hostdata import check_inventory, every_host_once_all_answered, settings_for, write_json
from tasks.run_summary import last_run
from tasks.settings import TRAIN_UNIT
from tasks.status import STAGES, _json_safe, box_status, boxes, nothing_to_report, parse_log, render_rows, unit_summary
from tasks.tracking.hub import HUB_UNIT, hub_name, hub_words, served_dir, served_here, shares_loopback

check_inventory()
settings = settings_for()
run, exports, burnin, hub_unit = ask(
    (TrainingRun, {"unit": TRAIN_UNIT, "markers": {s: settings.marker(s) for s in STAGES},
                   "plan_path": f"{settings.train_dir}/plan.json", "launcher": f"{settings.train_dir}/train-launcher",
                   "user": settings.train_user, "python": settings.launcher_python}),
    (RunExports, {"checkpoint_dir": f"{settings.train_dir}/checkpoints"}),
    (BurninRecord, {"record": burnin_paths(settings.train_dir)["record"], "user": settings.train_user,
                    "unit": BURNIN_UNIT}),
    (UnitState, {"unit": HUB_UNIT}))
unit_state, _ = unit_summary(run["unit"], run["history"])
verdict = None
if unit_state in ("failed", "crash-looping"):
    diag = diagnose(host.name, {"journal": run["journal"]}, run["plan"], failed=True)
    verdict = "\n".join(render(diag).splitlines()[1:]) or "the unit failed; the doctor found no cause"
elif unit_state == "never-ran":
    verdict = never_ran(host.name, run["preflight"], run["plan"])[1]
row = box_status(host.name, run["markers"], run["unit"], run["journal"], run["plan"], verdict, run["history"], exports,
                 last=last_run(settings.controller_cache, host.name))
row["tensorboard_serving"] = bool((hub_unit or {}).get("active"))     # the lab's TensorBoard unit on this box
record = burnin["record"]      # the box's last burn-in (docs/burnin.md)
row["burnin"] = {k: record.get(k) for k in ("state", "started", "ended", "wall_s", "failed", "reward", "speed")} \
    if record else None
row["burnin_notes"] = status_lines(record, "running" if burnin["unit"].get("ActiveState") in ("active", "activating")
                                   else None)
if settings.driver == "install":      # the held driver: a newer build of its branch, its end of life
    row["driver_notes"] = held_driver_notes(settings)

out_dir = settings.controller_cache / "status"
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / f"{host.name}.log").write_text(run["journal"])
rows = every_host_once_all_answered("status_rows", row)
burnin_records = every_host_once_all_answered("status_burnins", record)
if rows is not None:
    # the last box to answer prints the lab (the deploy file runs once per box, side by side)
    ordered = list(rows.values())
    print(render_rows(ordered), flush=True)
    idle = nothing_to_report(ordered)
    if idle:
        print(idle, flush=True)
    hub = hub_name(settings, [h.name for h in inventory])
    serving = rows[hub]["tensorboard_serving"] if hub in rows else None
    here = bool(serving) and shares_loopback(inventory.get_host(hub).data.dict()) and \
        served_here(settings.tracking.port, served_dir(settings_for(inventory.get_host(hub))))
    print(hub_words(settings, inventory, serving, here), flush=True)       # how to open the lab's TensorBoard
    target = host.data.get("status_json")
    if target:
        write_json(target, _json_safe({"hosts": ordered}))
        print(f"status of {boxes(len(ordered))}: {target}", flush=True)
    plots = host.data.get("status_plots")
    if plots:
        runs = {name: parse_log((out_dir / f"{name}.log").read_text()) for name in rows}
        scores = {name: row["gsm8k"] for name, row in rows.items()}
        if any(r.steps for r in runs.values()) or any(g and (g.get("base") is not None or g.get("trained") is not None)
                                                       for g in scores.values()):
            from tasks.plots import plot_all

            made = plot_all(runs, Path(plots), scores)
            print(f"plots: {', '.join(str(p) for p in made)}", flush=True)
        burnins = {name: r for name, r in burnin_records.items() if r}
        if burnins:
            from tasks.burnin.plots import plot_burnin

            Path(plots).mkdir(parents=True, exist_ok=True)
            made = [p for p in (plot_burnin(name, r, Path(plots)) for name, r in burnins.items()) if p]
            print(f"plots of the burn-ins: {', '.join(str(p) for p in made) or 'none (no scored step)'}", flush=True)
        else:
            print(f"plots: none (no box has finished a step); no GSM8K score either, so no folder made at {plots}",
                  flush=True)
