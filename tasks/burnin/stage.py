"""Stage: a box's burn-in (deploy/burnin.py; docs/burnin.md). It changes no training file and no checkpoint.

At prepare time, per box: the box's plan (as the train stage makes it, its cluster's on a cluster's head; a
cluster's worker runs nothing: the head's run is the cluster's), refused where the train stage has not proven its
launcher or the training unit runs or restarts; then the burn-in's files, each root's but its folder:

* beside the launcher: its part ``verl_lab_burnin.py`` and ``verl_lab_burnin_judge.py``, the driver
  ``verl_lab_burnin_driver.py`` and the weights check ``verl_lab_burnin_weights.py`` (verl_lab_box/burnin*.py);
* ``burnin-probe/``: the probe as ``sitecustomize.py`` and the reward manager (the runs' PYTHONPATH);
* ``burnin-plan.json`` (tasks/burnin/plan.py), with what earlier burn-ins of this card measured a step;
* ``burnin/``: the burn-in's folder, the train user's (its checkpoints, records and ``burnin.json``);
* ``verl-lab-burnin.service``: the training unit's template rendered with the same user, environment and
  sandbox, ``train-launcher --burnin`` as its command, its folder writable, no restart, never enabled.

A cluster's worker gets its part (``burnin_on_worker``: the folder its ranks save into, the probe); the head runs the
cluster's burn-in. At execute time the unit is started and waited for (``BURNIN_WAIT_S`` at most; a longer burn-in goes on and
deploy/status.py shows it); its record is kept in the controller's cache (``burnin/<host>.json`` and the card's
history, ``burnin/history.jsonl``) and the plan's hearing is printed. A failed burn-in fails that box, with its
reasons; the other boxes go on.
"""

from __future__ import annotations

import json
import shlex

import gevent
from pyinfra import logger
from pyinfra.api import deploy
from pyinfra.operations import python, server, systemd

from tasks.burnin.hearing import expected_step_s, hearing_words
from tasks.burnin.plan import BURNIN_UNIT, BurninSpec, burnin_paths, burnin_plan
from tasks.facts.bundle import ask
from tasks.facts.burnin import BurninRecord
from tasks.facts.files import Marker, PathStates, UnitState
from tasks.failure import fail_host
from tasks.placed import place, rendered, wanted_dir, wanted_file
from tasks.plan import PlanError
from tasks.settings import TRAIN_UNIT, LabSettings
from tasks.train import BOX_PACKAGE, UNIT_TEMPLATE, TrainingLayout, _flash_attn
from tasks.validation import training_plan

BESIDE_LAUNCHER = {"verl_lab_burnin.py": "burnin.py", "verl_lab_burnin_judge.py": "burnin_judge.py",
                   "verl_lab_burnin_driver.py": "burnin_driver.py", "verl_lab_burnin_weights.py": "burnin_weights.py"}
IN_PROBE = {"sitecustomize.py": "burnin_probe.py", "verl_lab_burnin_reward.py": "burnin_reward.py"}
UNIT_PATH = f"/etc/systemd/system/{BURNIN_UNIT}"
BURNIN_WAIT_S = 3600
BUSY = ("active", "activating", "deactivating", "reloading")


def burnin_wanted(layout: TrainingLayout, plan_json: str) -> list:
    """The folders and files the burn-in places (tasks/placed.py), folders first."""
    s, user = layout.settings, layout.settings.train_user
    paths = burnin_paths(s.train_dir)
    values = layout.values()
    unit = rendered(UNIT_TEMPLATE, **{**values, "unit_name": BURNIN_UNIT, "burnin": True,
                                      "read_write_paths": [*values["read_write_paths"], paths["folder"]]})
    return [
        wanted_dir(paths["folder"], f"Directory {paths['folder']} (the burn-in's, the train user's)", mode="750",
                   user=user, group=user),
        wanted_dir(paths["probe"], "Directory of the burn-in's probe", mode="750", group=user),
        *(wanted_file(f"{paths['probe']}/{name}", f"Burn-in probe {name}", (BOX_PACKAGE / src).read_bytes(),
                      mode="640", group=user) for name, src in IN_PROBE.items()),
        *(wanted_file(f"{s.train_dir}/{name}", f"Burn-in program {name}", (BOX_PACKAGE / src).read_bytes(),
                      mode="640", group=user) for name, src in BESIDE_LAUNCHER.items()),
        wanted_file(paths["plan"], "Burn-in plan (burnin-plan.json)", plan_json, mode="640", group=user),
        wanted_file(UNIT_PATH, f"Unit {BURNIN_UNIT}", unit),
    ]


def history_of(settings: LabSettings) -> list[dict]:
    """Every burn-in this controller kept (``burnin/history.jsonl`` in its cache)."""
    path = settings.controller_cache / "burnin" / "history.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def keep_record(settings: LabSettings, name: str, record: dict) -> None:
    """The record in the controller's cache, and a line of it in the card's history."""
    folder = settings.controller_cache / "burnin"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    line = {"host": name, "state": record.get("state"), "started": record.get("started"), "gpu": record.get("gpu"),
            "plan": {"overrides_sha256": (record.get("plan") or {}).get("overrides_sha256")},
            "speed": {"seconds_per_step": (record.get("speed") or {}).get("seconds_per_step")}}
    with open(folder / "history.jsonl", "a") as fh:
        fh.write(json.dumps(line) + "\n")


def wait_for_burnin(state, host, settings: LabSettings, plan: dict, seconds: float = BURNIN_WAIT_S,
                    poll_s: float = 5.0) -> bool:
    """Execute time, after the unit was started: wait until it ends, then read its record, keep it, say what it
    found. False (this box fails) where it failed or left no record."""
    paths = burnin_paths(settings.train_dir)
    args = {"record": paths["record"], "user": settings.train_user, "unit": BURNIN_UNIT}
    deadline, poll = gevent.get_hub().loop.now() + seconds, 0
    while True:
        poll += 1
        got = host.get_fact(BurninRecord, poll=poll, **args)
        if got["unit"].get("ActiveState") not in BUSY:
            break
        if gevent.get_hub().loop.now() > deadline:
            host.log_styled(f"{BURNIN_UNIT} still runs after {int(seconds)} s: deploy/status.py shows its record when "
                            "it ends", log_func=logger.warning)
            return True
        gevent.sleep(poll_s)
    record = got["record"]
    if not record or record.get("state") == "running":
        host.log_styled(f"verl-lab burn-in: {BURNIN_UNIT} ended ({got['unit'].get('Result', '?')}, exit "
                        f"{got['unit'].get('ExecMainStatus', '?')}) without a finished record"
                        f"{': ' + got['problem'] if got.get('problem') else ''}: deploy/doctor.py reads its journal",
                        fg="red", log_func=logger.error)
        return False
    keep_record(settings, host.name, record)
    words = hearing_words(record, plan)
    if record.get("state") == "passed":
        host.log_styled(f"verl-lab burn-in passed\n{words}", log_func=logger.info)
        return True
    fails = "\n".join(f"  FAIL {c['id']}: {c['words']}" for c in record.get("checks") or [] if c.get("ok") is False)
    host.log_styled(f"verl-lab burn-in FAILED: {', '.join(record.get('failed') or [])}\n{fails}\n{words}", fg="red",
                    log_func=logger.error)
    return False


@deploy("verl-lab burn-in: a Ray cluster worker's part")
def burnin_on_worker(settings: LabSettings):
    """A cluster worker's part of its head's burn-in: the folder its ranks save their shards and records into (the
    train user's; the train dir is root's) and the probe its Ray workers import, at the head's paths."""
    paths = burnin_paths(settings.train_dir)
    user = settings.train_user
    place([wanted_dir(paths["folder"], f"Directory {paths['folder']} (the burn-in's, the train user's)", mode="750",
                      user=user, group=user),
           wanted_dir(paths["probe"], "Directory of the burn-in's probe", mode="750", group=user),
           *(wanted_file(f"{paths['probe']}/{name}", f"Burn-in probe {name}", (BOX_PACKAGE / src).read_bytes(),
                         mode="640", group=user) for name, src in IN_PROBE.items())])


@deploy("verl-lab burn-in")
def run_burnin(settings: LabSettings, gpu, cluster_targets: dict | None = None, spec: BurninSpec | None = None):
    """The box's burn-in: its files and unit placed, the unit started and waited for (module docstring); ``spec``:
    the burn-in's own (``BurninSpec()`` where none is given)."""
    spec = spec or BurninSpec()
    paths = burnin_paths(settings.train_dir)
    env_marker, train_marker, train_unit, burnin_unit, states = ask(
        (Marker, {"path": settings.marker("env"), "legacy": settings.legacy_marker("env")}),
        (Marker, {"path": settings.marker("train")}), (UnitState, {"unit": TRAIN_UNIT}),
        (UnitState, {"unit": BURNIN_UNIT}),
        (PathStates, {"paths": [paths["folder"], paths["probe"], *(f"{paths['probe']}/{n}" for n in IN_PROBE),
                                *(f"{settings.train_dir}/{n}" for n in BESIDE_LAUNCHER), paths["plan"], UNIT_PATH]}))
    if gpu.target is None:
        fail_host(name="Burn-in needs a GPU", message=gpu.problem or "no GPU target", stage="burnin")
        return
    if not train_marker:
        fail_host(name="Burn-in needs the training stage", stage="burnin",
                  message="the train stage has not proven its launcher on this box: run deploy/full.py (or "
                          "deploy/train.py) first")
        return
    train_unit = train_unit or UnitState.default()
    if train_unit["active"] or train_unit["crash_looping"]:
        fail_host(name="Burn-in refused", stage="burnin",
                  message=f"{TRAIN_UNIT} is {'crash-looping' if train_unit['crash_looping'] else 'running'}: a burn-in "
                          "never runs beside the training unit; stop it first (train_unit_state = \"stopped\", then "
                          "deploy/train.py)")
        return
    try:
        plan = training_plan(settings, gpu.target, cluster_targets, _flash_attn(env_marker))
    except PlanError as exc:
        fail_host(name=f"Burn-in plan for {gpu.target.count} x {gpu.target.name}", message=str(exc), stage="burnin")
        return
    layout = TrainingLayout(settings=settings, plan=plan, plan_source=gpu.source)
    d = plan.to_dict()
    expected = expected_step_s(history_of(settings), plan.gpu.name,
                               burnin_plan(plan, settings.train_dir, settings.host, spec)["plan_summary"]["overrides_sha256"])
    bp = burnin_plan(plan, settings.train_dir, settings.host, spec, expected)
    changed = place(burnin_wanted(layout, json.dumps(bp, indent=2, sort_keys=True) + "\n"), states)
    if changed[UNIT_PATH] is not None:
        systemd.daemon_reload(name="systemd reads the burn-in unit")
    if not (burnin_unit or UnitState.default())["active"]:
        u = shlex.quote(BURNIN_UNIT)
        server.shell(name=f"Start {BURNIN_UNIT} ({spec.total_steps} steps of the plan {plan.rung}, "
                          f"{plan.gpu.count} x {plan.gpu.name})",
                     commands=[f"systemctl reset-failed {u} 2>/dev/null || true; systemctl start --no-block {u}"])
    python.call(name=f"{BURNIN_UNIT}: wait for its record (at most {BURNIN_WAIT_S} s)", function=wait_for_burnin,
                settings=settings, plan=d)
