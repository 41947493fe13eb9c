"""The Ray cluster units alone: `pyinfra inventory/lab.py deploy/cluster.py`.

Runs after the training stage in deploy/full.py, on the boxes whose host data puts them in a
cluster (tasks/cluster.py); a box that trains alone gets nothing here.
"""

from tasks.base import base_layout
from tasks.cluster import install_cluster
from tasks.hostdata import check_inventory, cluster_for, member_targets, settings_for

check_inventory()
settings = settings_for()
cluster = cluster_for()

if cluster:
    gpu = base_layout(settings)
    if not gpu.refused:
        install_cluster(settings, gpu, cluster, member_targets(cluster, settings.host, gpu.target))
