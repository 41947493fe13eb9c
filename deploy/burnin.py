"""A burn-in on each box before its long run: `pyinfra -y inventory/lab.py deploy/burnin.py` (docs/burnin.md).

A few minutes of verl on the box's own plan (rung, precision, micro-batches, offloads, rollout engine, LoRA, its
Ray cluster from the head) in its own folder, with a reward any model climbs: the reward must rise, the save must
resume and export with its proof, and the record (``<train_dir>/burnin/burnin.json``) puts the card's memory per
phase and its seconds per step beside the plan's and the speed model's (tasks/burnin/stage.py). Refused where
the training unit runs; never touches the run's checkpoints or tracker runs. deploy/status.py shows each box's
last burn-in, deploy/doctor.py reads a failed one.
"""

from tasks.base import base_layout
from tasks.burnin.stage import burnin_on_worker, run_burnin
from tasks.cluster import training_in
from tasks.hostdata import check_inventory, cluster_for, settings_for

check_inventory()
settings = settings_for()
cluster = cluster_for()

gpu = base_layout(settings)
if not gpu.refused:
    if cluster is not None and cluster.role(settings.host) != "head":
        burnin_on_worker(settings)        # the head runs the cluster's burn-in; its ranks here save into this folder
    else:
        burnin_settings, targets = training_in(cluster, settings, gpu)
        run_burnin(burnin_settings, gpu, targets)
