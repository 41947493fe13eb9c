"""The lab's training curves: `pyinfra -y inventory/lab.py deploy/tracking.py`.

Every box's TensorBoard event files (verl's `trainer.logger` tensorboard, settings `tracking`) are copied
into the controller cache, then onto the hub box (`tracking.hub`, else the inventory's first box), whose
`verl-lab-tensorboard.service` serves them on 127.0.0.1:6006 (tasks/tracking/hub.py); beside verl's scalars,
each box's GSM8K base -> trained scores and its plan's predicted peak (run `<box>/verl-lab`). Both legs carry
only the bytes a file gained, read on the box as the train user (tasks/tracking/copy.py). The offline runs of
wandb, SwanLab and MLflow are copied into the controller cache too and synced from there with the
controller's keys, each run once (tasks/tracking/sync.py), including the cached runs of a box gone from the
inventory. Re-run it to bring the curves up to date; a box that went away keeps what was copied.
`deploy/status.py` says how to open it (the SSH tunnel to a serving hub).

A hub that is not provisioned (no train user, or no TensorBoard in its env: deploy/full.py makes both) refuses
the run before anything changes on any box; another box not provisioned has nothing to copy and is left as it
is, said so. A box that is no longer the hub (another `tracking.hub`, or no 'tensorboard' in
`tracking.trackers`) has its TensorBoard unit stopped, disabled and removed and its served copy removed (the
controller's cache keeps every box's curves); a box whose trackers are no longer copied has the copy's
programs removed (tasks/undo.py).
"""

from pyinfra import host, inventory, logger, state
from pyinfra.operations import python

from tasks.facts.bundle import ask
from tasks.facts.data import PythonModules
from tasks.facts.export import RunExports
from tasks.facts.files import PasswdEntry
from tasks.facts.logs import TrainingRun
from tasks.hostdata import check_inventory, settings_for
from tasks.settings import TRAIN_UNIT
from tasks.status import STAGES, box_status
from tasks.tracking.copy import collect, install_copy_program
from tasks.tracking.hub import (
    HubNotProvisioned,
    box_events_dir,
    cache_dir,
    hub_name,
    install_tracking_hub,
    write_summary,
)
from tasks.tracking.sync import boxes_root, collect_offline_runs, sync_offline_runs
from tasks.undo import hub_role, undo_unwanted

check_inventory()
settings = settings_for()
hosts = [h.name for h in inventory]
hub = hub_name(settings, hosts)
if "tensorboard" in settings.tracking.trackers and hub not in hosts:
    raise SystemExit(f"host {host.name}: tracking.hub: {hub!r} is not a box of this inventory. "
                     "Fix: name one of its boxes, or leave tracking.hub out (the inventory's first box)")
is_hub, copied, _ = hub_role(settings, hosts)

user, modules, run, exports = ask(
    (PasswdEntry, {"user": settings.train_user}),
    (PythonModules, {"python": settings.env_python, "modules": ["tensorboard"]}),
    (TrainingRun, {"unit": TRAIN_UNIT, "markers": {s: settings.marker(s) for s in STAGES},
                   "plan_path": f"{settings.train_dir}/plan.json", "launcher": f"{settings.train_dir}/train-launcher",
                   "user": settings.train_user, "python": settings.launcher_python}),
    (RunExports, {"checkpoint_dir": f"{settings.train_dir}/checkpoints"}))
missing = ([f"no user {settings.train_user}"] if not user else []) + \
    ([] if (modules or {}).get("tensorboard") else [f"no TensorBoard in its env ({settings.env_python})"])
if is_hub and missing:
    raise HubNotProvisioned(
        f"verl-lab tracking: the hub {host.name} is not provisioned ({'; '.join(missing)}): nothing was changed on "
        f"any box. Fix: pyinfra -y <inventory> deploy/full.py --limit {host.name} first, or set tracking.hub to a "
        "box deploy/full.py provisioned")
provisioned = bool(user)
if not provisioned:
    host.log_styled(f"verl-lab tracking: {host.name} is not provisioned (no user {settings.train_user}): it has no "
                    "curves to copy; nothing on it was changed (deploy/full.py provisions it)", log_func=logger.warning)
row = box_status(host.name, run["markers"], run["unit"], run["journal"], run["plan"], None, run["history"], exports)
write_summary(cache_dir(settings), host.name, {"gsm8k": row["gsm8k"], "predicted_peak_mib": row["predicted_peak_mib"],
                                               "peak_mib": row["peak_mib"], "step": row["step"]})

if provisioned and copied:
    install_copy_program(settings)
if provisioned and "tensorboard" in settings.tracking.trackers:
    python.call(name="This box's TensorBoard event files into the controller cache (the bytes each gained)",
                function=collect, settings=settings, remote_root=box_events_dir(settings),
                local_root=str(cache_dir(settings) / host.name))
if provisioned:
    collect_offline_runs(settings)

# what this deploy placed and the settings no longer ask for on this box: the hub's unit and served copy, the
# copy's programs; before a new hub starts (every box's undo runs before any box's hub operations)
undo_unwanted(settings, ("hub", "copy"), True, False, hosts)
if is_hub:
    install_tracking_hub(settings)
# once a run, on the first box that answered: every box's cached offline runs, those of boxes gone too
known = {h.name: settings_for(h) for h in inventory}
syncer = next(h.name for h in inventory if h in state.active_hosts)
if host.name == syncer and (boxes_root(settings).is_dir() or any(s.tracking.offline for s in known.values())):
    sync_offline_runs(settings, known)
