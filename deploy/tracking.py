"""The lab's training curves: `pyinfra -y inventory/lab.py deploy/tracking.py`.

Every box's TensorBoard event files (verl's `trainer.logger` tensorboard, settings `tracking`) are copied
into the controller cache, then onto the hub box (`tracking.hub`, else the inventory's first box), whose
`verl-lab-tensorboard.service` serves them on 127.0.0.1:6006 (tasks/tracking_hub.py); beside verl's scalars,
each box's GSM8K base -> trained scores and its plan's predicted peak (run `<box>/verl-lab`). Both legs carry
only the bytes a file gained, read on the box as the train user (tasks/tracking_copy.py). The offline runs of
wandb, SwanLab and MLflow are copied into the controller cache too and synced from there with the
controller's keys, each run once (tasks/tracking_sync.py), including the cached runs of a box gone from the
inventory. Re-run it to bring the curves up to date; a box that went away keeps what was copied.
`deploy/status.py` prints the SSH tunnel to open it.
"""

from pyinfra import host, inventory, state
from pyinfra.operations import python

from tasks.facts.bundle import ask
from tasks.facts.export import RunExports
from tasks.facts.logs import TrainingRun
from tasks.hostdata import check_inventory, settings_for
from tasks.settings import TRAIN_UNIT
from tasks.status import STAGES, box_status
from tasks.tracking_copy import collect, install_copy_program
from tasks.tracking_hub import box_events_dir, cache_dir, hub_name, install_tracking_hub, write_summary
from tasks.tracking_sync import boxes_root, collect_offline_runs, sync_offline_runs

check_inventory()
settings = settings_for()
hub = hub_name(settings, [h.name for h in inventory])
if "tensorboard" in settings.tracking.trackers and hub not in [h.name for h in inventory]:
    raise SystemExit(f"host {host.name}: tracking.hub: {hub!r} is not a box of this inventory. "
                     "Fix: name one of its boxes, or leave tracking.hub out (the inventory's first box)")

run, exports = ask(
    (TrainingRun, {"unit": TRAIN_UNIT, "markers": {s: settings.marker(s) for s in STAGES},
                   "plan_path": f"{settings.train_dir}/plan.json", "launcher": f"{settings.train_dir}/train-launcher",
                   "user": settings.train_user, "python": settings.launcher_python}),
    (RunExports, {"checkpoint_dir": f"{settings.train_dir}/checkpoints"}))
row = box_status(host.name, run["markers"], run["unit"], run["journal"], run["plan"], None, run["history"], exports)
write_summary(cache_dir(settings), host.name, {"gsm8k": row["gsm8k"], "predicted_peak_mib": row["predicted_peak_mib"],
                                               "peak_mib": row["peak_mib"], "step": row["step"]})

if "tensorboard" in settings.tracking.trackers or settings.tracking.offline or host.name == hub:
    install_copy_program(settings)
if "tensorboard" in settings.tracking.trackers:
    python.call(name="This box's TensorBoard event files into the controller cache (the bytes each gained)",
                function=collect, settings=settings, remote_root=box_events_dir(settings),
                local_root=str(cache_dir(settings) / host.name))
collect_offline_runs(settings)

if host.name == hub and "tensorboard" in settings.tracking.trackers:
    install_tracking_hub(settings)
# once a run, on the first box that answered: every box's cached offline runs, those of boxes gone too
known = {h.name: settings_for(h) for h in inventory}
syncer = next(h.name for h in inventory if h in state.active_hosts)
if host.name == syncer and (boxes_root(settings).is_dir() or any(s.tracking.offline for s in known.values())):
    sync_offline_runs(settings, known)
