"""Rebuild the Python env: `pyinfra inventory/lab.py deploy/rebuild.py`.

Builds a new env generation beside the current one, proves it, then swaps it in; the current
env stays in place (and in use) until the new one passes, and is kept as <env_prefix>.prev.
"""

from tasks.hostdata import check_inventory, settings_for
from tasks.base import base_layout
from tasks.env import install_env

check_inventory()
settings = settings_for()

gpu = base_layout(settings)
if not gpu.refused:
    install_env(settings, gpu, force_rebuild=True)
