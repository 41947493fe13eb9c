"""Provision every box end to end: `pyinfra inventory/lab.py deploy/full.py`.

Stages run in order; each is idempotent alone and has its own deploy file.
"""

from tasks.hostdata import check_inventory, settings_for
from tasks.base import base_layout

check_inventory()
settings = settings_for()

base_layout(settings)
