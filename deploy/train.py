"""Training plan, launcher and systemd unit alone: `pyinfra inventory/lab.py deploy/train.py`.

Runs after the env and data stages in deploy/full.py; alone it still writes the plan, the
launcher and the unit (the launcher's --check then reports what is missing).
"""

from tasks.base import base_layout
from tasks.cluster import training_in
from tasks.hostdata import check_inventory, cluster_for, settings_for
from tasks.train import install_train

check_inventory()
settings = settings_for()

gpu = base_layout(settings)
if not gpu.refused:
    train_settings, targets = training_in(cluster_for(), settings, gpu)   # a cluster member: the cluster's plan
    install_train(train_settings, gpu, targets)
