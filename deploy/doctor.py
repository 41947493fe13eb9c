"""Diagnose failed training runs and broken boxes: `pyinfra -y inventory/lab.py deploy/doctor.py`.

Reads each box's training-unit journal, the stage logs and plan.json (changes nothing), matches
them against files/doctor/rules.toml and prints, per host, what failed, why and what to run.
`--data doctor_json=True` prints one JSON object per host instead (also saved under the
controller cache as doctor/<host>.json).
"""

import json

from pyinfra import host

from tasks.doctor import diagnose, render
from tasks.facts.logs import BoxLogs
from tasks.hostdata import check_inventory, settings_for
from tasks.settings import TRAIN_UNIT

check_inventory()
settings = settings_for()
logs = host.get_fact(BoxLogs, unit=TRAIN_UNIT, log_glob=f"{settings.lab_root}/logs/*.log",
                     plan_path=f"{settings.train_dir}/plan.json")
unit_failed = "failed" in logs["unit_state"] or "exit-code" in logs["unit_state"]
diag = diagnose(host.name, logs["sources"], logs["plan"], failed=True if unit_failed else None)
report = diag.to_json() | {"unit_state": logs["unit_state"]}
out_dir = settings.controller_cache / "doctor"
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / f"{host.name}.json").write_text(json.dumps(report, indent=2))
if host.data.get("doctor_json") in (True, "True", "true", "1"):
    print(json.dumps(report), flush=True)
else:
    print(render(diag) + (f"\n  unit: {logs['unit_state']}" if logs["unit_state"] else ""), flush=True)
