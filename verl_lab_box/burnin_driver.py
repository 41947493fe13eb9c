"""The burn-in's verl run: ``verl.trainer.main_ppo`` with the burn-in's probe in every process of the run.

    <env>/bin/python verl_lab_burnin_driver.py --probe DIR --records DIR -- OVERRIDE ...

Placed by the burn-in stage (tasks/burnin/stage.py) as ``<train_dir>/verl_lab_burnin_driver.py``; the launcher's
burn-in (verl_lab_box/burnin.py) runs it with the env's Python, as the training unit runs verl. verl 0.5.0's
``main_ppo`` starts Ray itself only when Ray is not started yet: this program starts it first (a local Ray, or the
cluster's where ``RAY_ADDRESS`` names one, as main_ppo would) with verl's own runtime environment plus the probe's
folder on ``PYTHONPATH`` and ``VERL_LAB_BURNIN_RECORDS``, so that the TaskRunner and the workers on every node import
the probe (verl_lab_box/burnin_probe.py as ``sitecustomize.py``) and its reward manager; then it runs main_ppo's
Hydra entry with the overrides, and stops Ray (a local one with it). Its exit status is verl's.
"""

from __future__ import annotations

import argparse
import os
import sys


def runtime_env(probe: str, records: str, base: dict) -> dict:
    """verl's runtime environment with the probe's folder first on ``PYTHONPATH`` and the records folder named."""
    env_vars = dict(base.get("env_vars") or {})
    path = [probe, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != probe)]
    env_vars.update(PYTHONPATH=os.pathsep.join(path), VERL_LAB_BURNIN_RECORDS=records)
    return {**base, "env_vars": env_vars}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(prog="verl_lab_burnin_driver.py", description=__doc__.splitlines()[0])
    ap.add_argument("--probe", required=True, help="the folder holding the probe's sitecustomize.py")
    ap.add_argument("--records", required=True, help="where the probe and the reward write their JSON lines")
    args = ap.parse_args(argv[:cut])
    overrides = argv[cut + 1:]
    import ray
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    env = runtime_env(os.path.abspath(args.probe), os.path.abspath(args.records), get_ppo_ray_runtime_env())
    os.environ.update(env["env_vars"])          # a local Ray's processes inherit them as well
    ray.init(runtime_env=env)
    try:
        from verl.trainer.main_ppo import main as verl_main

        sys.argv = ["verl.trainer.main_ppo", *overrides]
        verl_main()
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
