"""Training plan, launcher and systemd unit alone: `pyinfra inventory/lab.py deploy/train.py`.

Runs after the env and data stages in deploy/full.py; alone it still writes the plan, the
launcher and the unit (the launcher's --check then reports what is missing). What the training unit no
longer needs is removed (tasks/undo.py): the drop-in of a Ray cluster the box left, the keys of a tracker
that logs offline now, an empty folder of a tracker no longer named. It ends with a line per host
(tasks/run_summary.py), as deploy/full.py does.
"""

from pyinfra import inventory

from tasks.base import base_layout
from tasks.cluster import training_in
from tasks.hostdata import check_inventory, cluster_for, settings_for
from tasks.run_summary import note, note_plan, note_target, stage
from tasks.train import install_train
from tasks.undo import undo_unwanted

check_inventory()
settings = settings_for()

with stage("base"):
    gpu = base_layout(settings)
note_target(gpu, unit=settings.train_unit_state)
if not gpu.refused:
    cluster = cluster_for()
    train_settings, targets = training_in(cluster, settings, gpu)   # a cluster member: the cluster's plan
    note(unit=train_settings.train_unit_state)
    hosts, worker = [h.name for h in inventory], bool(cluster) and cluster.role(settings.host) == "worker"
    with stage("undo"):
        left = undo_unwanted(settings, ("dropin",), bool(cluster), worker, hosts)
    with stage("train"):
        install_train(train_settings, gpu, targets, "the cluster's drop-in removed" if left else None)
    with stage("undo"):
        undo_unwanted(settings, ("trackers",), bool(cluster), worker, hosts)
    note_plan(train_settings, gpu.target, targets)
