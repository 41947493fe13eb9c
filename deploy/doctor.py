"""Diagnose failed training runs and broken boxes: `pyinfra -y inventory/lab.py deploy/doctor.py`.

Reads each box's training-unit journal (its current run), the stage logs, the Ray unit's journal
on a cluster member and the burn-in unit's (since the unit last became active), the last burn-in's
record (its failed checks: files/doctor/burnin.toml) and plan.json (changes nothing), matches
them against the rules of files/doctor/*.toml and prints, per host, what failed, why and what to run; each
finding names the log or unit it was seen in. A unit that never ran is said to be so, with what
the launcher's preflight (run as the train user) says would stop it. `--data doctor_json=PATH`
also writes every host's report as one JSON file (`--data doctor_json=True`: the controller
cache's doctor/lab.json); each host's report is saved as doctor/<host>.json under the controller
cache either way.
"""

import json
from pathlib import Path

from pyinfra import host

from tasks.burnin import BURNIN_UNIT, burnin_paths
from tasks.cluster import RAY_UNIT
from tasks.doctor import FINE, RUNNING, STOPPED, diagnose, never_ran, render, verdict
from tasks.facts.bundle import ask
from tasks.facts.burnin import BurninRecord
from tasks.facts.driver import DriverMasks
from tasks.facts.logs import BoxLogs, TrainingRun
from tasks.hostdata import check_inventory, every_host_once_all_answered, settings_for, write_json
from tasks.run_summary import last_run
from tasks.settings import TRAIN_UNIT
from tasks.status import STAGES, not_installed_reason, unit_summary


def hosts_words(n: int) -> str:
    return f"{n} host" if n == 1 else f"{n} hosts"


check_inventory()
settings = settings_for()
logs, run, burnin, masks = ask(
    (BoxLogs, {"log_glob": f"{settings.lab_root}/logs/*.log", "units": [RAY_UNIT, BURNIN_UNIT]}),
    (TrainingRun, {"unit": TRAIN_UNIT, "markers": {st: settings.marker(st) for st in STAGES}, "plan_path": f"{settings.train_dir}/plan.json",
                   "launcher": f"{settings.train_dir}/train-launcher", "user": settings.train_user,
                   "python": settings.launcher_python, "steps": False}),
    (BurninRecord, {"record": burnin_paths(settings.train_dir)["record"], "user": settings.train_user,
                    "unit": BURNIN_UNIT}),
    (DriverMasks, {"units": [TRAIN_UNIT, RAY_UNIT, BURNIN_UNIT]}),   # what a driver change that ended badly left masked
)
logs = {**(logs or {}), **(masks or {})}
if (burnin["record"] or {}).get("state") == "failed":
    # the last burn-in's failed checks as its launcher printed them (files/doctor/burnin.toml), from its record: the
    # burn-in unit's journal may have moved on
    logs["burn-in record"] = "\n".join(f"verl-lab burn-in: FAIL {c['id']}: {c['words']}"
                                        for c in burnin["record"].get("checks") or [] if c.get("ok") is False)
unit_state, unit_words = unit_summary(run["unit"], run["history"])
if unit_state == "never-ran":
    # nothing failed yet: what would stop it is what the preflight says now
    preflight, words = never_ran(host.name, run["preflight"], run["plan"],
                                 lead="never ran (installed, never started)")
    diag = diagnose(host.name, logs, run["plan"])
    diag.verdict = preflight.verdict          # the headline: never ran, and whether its preflight fails
    report = diag.to_json() | {"unit": unit_state, "unit_state": unit_words,
                               "preflight": {"output": run["preflight"], "findings": preflight.to_json()["findings"]}}
    text = render(diag) + "\n  unit: " + words
else:
    failed = True if unit_state in ("failed", "crash-looping") else None
    diag = diagnose(host.name, {TRAIN_UNIT: run["journal"], **logs}, run["plan"], failed=failed)
    diag.verdict = verdict(diag, unit_state)
    report = diag.to_json() | {"unit": unit_state, "unit_state": unit_words}
    text = render(diag) + (f"\n  unit: {unit_state}: {unit_words}" if run["unit"] else "")
    if unit_state == "not-installed":
        # why there is no unit: the controller's record of the box's last deploy/full.py
        why = not_installed_reason([st for st in STAGES if (run.get("markers") or {}).get(st)],
                                   last_run(settings.controller_cache, host.name))
        if why:
            report["reason"] = why
            text += f"\n  why: {why}"
out_dir = settings.controller_cache / "doctor"
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / f"{host.name}.json").write_text(json.dumps(report, indent=2))
print(text, flush=True)

reports = every_host_once_all_answered("doctor_reports", report)
if reports is not None:
    quiet = [r for r in reports.values() if r.get("verdict") in (FINE, RUNNING, STOPPED) and not r.get("findings")]
    if len(quiet) == len(reports):
        print(f"doctor: nothing to diagnose on {hosts_words(len(reports))}: no unit failed or is failing, and no "
              "stage log or journal holds a known failure", flush=True)
target = host.data.get("doctor_json")
if target and reports is not None:
    # the last host to answer writes the lab's JSON (the deploy file runs once per host)
    path = out_dir / "lab.json" if target in (True, "True", "true", "1") else Path(target)
    write_json(path, {"hosts": list(reports.values())})
    print(f"doctor's reports of {hosts_words(len(reports))}: {path}", flush=True)
