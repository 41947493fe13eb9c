"""Training plan, launcher and systemd unit alone: `pyinfra inventory/lab.py deploy/train.py`.

Runs after the env and data stages in deploy/full.py; alone it still writes the plan, the
launcher and the unit (the launcher's --check then reports what is missing).
"""

from tasks.base import base_layout
from tasks.hostdata import check_inventory, settings_for
from tasks.train import install_train

check_inventory()
settings = settings_for()

gpu = base_layout(settings)
install_train(settings, gpu)
