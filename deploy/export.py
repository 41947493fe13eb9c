"""Export and score each box's latest checkpoint now: `pyinfra -y inventory/lab.py deploy/export.py`.

What a finished run does by itself (the launcher's ``after_run``, verl_lab_box/after_run.py), on demand: as
the train user, `train-launcher --export` turns the latest actor checkpoint into a proven Hugging
Face folder beside it (`<train_dir>/checkpoints/global_step_N/hf`, its proof `hf.proof.json`) and
scores the base model (once) and the export on GSM8K's test split (`gsm8k-base.json`,
`global_step_N/hf.gsm8k.json`). An export of a run still training is recorded as not final.

A box whose training unit is running gets the export only (it runs on the CPU): the score needs
the GPU that training holds, and comes when the run finishes. A box whose latest checkpoint is
proven and scored changes nothing; so does a box with no checkpoint. Proven means the files bear
the proof out (tasks/facts/export.py lists `hf/` against it): a deleted `hf/` is exported again.
An export of the same step already under way on the box (the unit's own after-run) is waited for
(the step's lock: verl_lab_box/checkpoints.py `step_lock`), then found proven; exports of saves
verl removed are pruned first; where the box's available RAM cannot hold the export (plan.json's
`export_host_ram`) the export refuses it with the fix. `deploy/status.py` shows `base -> trained`
per box.
"""

import shlex

from pyinfra import host, logger
from pyinfra.operations import server

from tasks.facts.bundle import ask
from tasks.facts.export import RunExports
from tasks.facts.files import UnitState
from tasks.hostdata import check_inventory, settings_for
from tasks.settings import TRAIN_UNIT

check_inventory()
settings = settings_for()
exports, unit = ask((RunExports, {"checkpoint_dir": f"{settings.train_dir}/checkpoints"}), (UnitState, {"unit": TRAIN_UNIT}))
step = exports["latest_step"]
latest = next((e for e in exports["exports"] if e["step"] == step), None) or {}
proven = bool((latest.get("proof") or {}).get("ok"))
scored = proven and bool(latest.get("score")) and bool(exports["base"])
training = unit["active"]
# what is not done is said without -v too (host.noop's words show only with -v)
if step is None:
    host.log_styled(f"verl-lab export: {host.name}: nothing to export: no checkpoint yet in {settings.train_dir}/"
                    "checkpoints (a run saves one every checkpoints.every steps)", log_func=logger.info)
elif scored or (proven and training):
    host.log_styled(f"verl-lab export: {host.name}: step {step} already exported and proven"
                    + (", scores wait for the run to finish" if not scored else " and scored"), log_func=logger.info)
else:
    q = shlex.quote
    server.shell(
        name=f"Export step {step} (proven Hugging Face folder)" + (" and score it on GSM8K" if not training else
                                                                   "; the score waits: the GPU is training"),
        commands=[f"runuser -u {q(settings.train_user)} -- {q(settings.launcher_python)} "
                  f"{q(settings.train_dir + '/train-launcher')} --export" + (" --no-score" if training else "")],
    )
