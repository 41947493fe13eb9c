"""Rebuild the Python env: `pyinfra inventory/lab.py deploy/rebuild.py`.

Builds a new env generation beside the current one, proves it, then swaps it in; the current
env stays in place (and in use) until the new one passes, and is kept as <env_prefix>.prev.
It ends with a line per host (tasks/run_summary.py): the env rebuilt (changed) or FAILED, and why above.
"""

from tasks.base import base_layout
from tasks.env import install_env
from tasks.hostdata import check_inventory, settings_for
from tasks.run_summary import note_target, stage

check_inventory()
settings = settings_for()

with stage("base"):
    gpu = base_layout(settings)
note_target(gpu, unit="untouched (a rebuild leaves the training unit as it is)")
if not gpu.refused:
    with stage("env"):
        install_env(settings, gpu, force_rebuild=True)
