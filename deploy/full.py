"""Provision every box end to end: `pyinfra -y inventory/lab.py deploy/full.py`.

Stages run in this order; each is idempotent alone and has its own deploy file
(deploy/cuda.py, env.py, data.py, train.py; cluster.py only for boxes in a Ray cluster). A box
whose env is broken gets it rebuilt beside the old one (the env stage swaps only after the new env passes its proofs).
"""

from dataclasses import replace

from tasks.base import base_layout
from tasks.cluster import install_cluster, member_targets
from tasks.cuda import install_cuda
from tasks.data import install_data
from tasks.hostdata import check_inventory, cluster_for, settings_for
from tasks.env import install_env
from tasks.train import install_train

check_inventory()
settings = settings_for()

gpu = base_layout(settings)        # the host's GPU target, decided once for every stage
install_cuda(settings, gpu)
install_env(settings, gpu)
install_data(settings)
cluster = cluster_for()            # None: the box trains alone
if cluster is None:
    install_train(settings, gpu)
else:                              # one plan for the cluster; only the head's unit trains (over Ray)
    targets = member_targets(cluster, settings.host, gpu.target)
    head = cluster.role(settings.host) == "head"
    install_train(settings if head else replace(settings, train_unit_state="installed"), gpu, targets)
    install_cluster(settings, gpu, cluster, targets)
