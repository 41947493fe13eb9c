"""The Python env stage alone: `pyinfra inventory/lab.py deploy/env.py`."""

from tasks.base import base_layout
from tasks.env import install_env
from tasks.hostdata import check_inventory, settings_for

check_inventory()
settings = settings_for()

gpu = base_layout(settings)
if not gpu.refused:                # a box that cannot train builds nothing
    install_env(settings, gpu)
