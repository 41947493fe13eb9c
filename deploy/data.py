"""Model and dataset alone: `pyinfra inventory/lab.py deploy/data.py`.

Runs after the env stage (the box-side GSM8K conversion uses the env's pyarrow; direct mode
downloads with the env's huggingface_hub).
"""

from tasks.base import base_layout
from tasks.data.stage import install_data
from tasks.hostdata import check_inventory, settings_for

check_inventory()
settings = settings_for()

if not base_layout(settings).refused:        # a box that cannot train fetches nothing
    install_data(settings)
