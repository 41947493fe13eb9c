"""The Ray cluster units alone: `pyinfra inventory/lab.py deploy/cluster.py`.

Runs after the training stage in deploy/full.py, on the boxes whose host data puts them in a
cluster (tasks/cluster.py). A box that trains alone gets nothing here, and what an earlier cluster left on it
is undone (tasks/undo.py): its Ray unit stopped, disabled and removed, the training unit's drop-in, ray.env,
the cluster's programs and Ray's folder removed, /etc/hosts restored.
"""

from pyinfra import inventory

from tasks.base import base_layout
from tasks.cluster import install_cluster
from tasks.hostdata import check_inventory, cluster_for, member_targets, settings_for
from tasks.undo import undo_unwanted

check_inventory()
settings = settings_for()
cluster = cluster_for()

if cluster:
    gpu = base_layout(settings)
    if not gpu.refused:
        install_cluster(settings, gpu, cluster, member_targets(cluster, settings.host, gpu.target))
else:
    undo_unwanted(settings, ("dropin", "ray"), False, False, [h.name for h in inventory])
