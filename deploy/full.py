"""Provision every box end to end: `pyinfra -y inventory/lab.py deploy/full.py`.

Stages run in this order; each is idempotent alone and has its own deploy file
(deploy/driver.py, cuda.py, env.py, data.py, train.py; cluster.py only for boxes in a Ray cluster). A box
whose env is broken gets it rebuilt beside the old one (the env stage swaps only after the new env passes its proofs).
What a setting no longer asks for (a Ray cluster left, a tracker dropped, another TensorBoard hub, the driver
stage's hold and pin after driver = "check") is undone in the same run, an operation each saying what and why
(tasks/undo.py, tasks/driver/release.py; the run's outputs and the installed driver are kept).
The run ends with one line per host (tasks/run_summary.py): each stage proven, checked or changed, the
plan in one line, the unit's state.
"""

from pyinfra import inventory

from tasks.base import base_layout, check_run
from tasks.cluster import install_cluster, training_in
from tasks.cuda import install_cuda
from tasks.data.stage import install_data
from tasks.driver.stage import install_driver
from tasks.env import install_env
from tasks.hostdata import cluster_for, settings_for
from tasks.run_summary import note, note_plan, note_target, stage
from tasks.train import install_train
from tasks.undo import driver_found, undo_unwanted


def provision() -> None:
    """This host's stages, in order."""
    settings = settings_for()
    with stage("base"):
        gpu = base_layout(settings)    # the host's GPU target, decided once for every stage
    note_target(gpu, unit=settings.train_unit_state, cache=str(settings.controller_cache))
    if not gpu.refused:                # driver = "install" only; the CUDA stage then trusts its proof
        if settings.driver == "install":
            with stage("driver"):
                gpu = install_driver(settings, gpu)
        else:                          # driver = "check": the CUDA stage judges it; a hold the stage left is released
            with stage("undo"):        # its facts come with the undo stage's one bundle (no command of its own)
                gpu = install_driver(settings, gpu, driver_found(settings))
    if not gpu.refused:                # a box that cannot train: its failure only, nothing else queued
        with stage("cuda"):
            install_cuda(settings, gpu)
        with stage("env"):
            install_env(settings, gpu)
        with stage("data"):
            install_data(settings)
        cluster = cluster_for()        # None: the box trains alone (and nothing below asks more)
        train_settings, targets = training_in(cluster, settings, gpu)
        note(unit=train_settings.train_unit_state)
        hosts, worker = [h.name for h in inventory], bool(cluster) and cluster.role(settings.host) == "worker"
        with stage("undo"):            # a cluster left: before the train stage (re)starts its unit without it
            left = undo_unwanted(settings, ("dropin", "ray"), bool(cluster), worker, hosts)
        with stage("train"):
            install_train(train_settings, gpu, targets,
                          "the cluster's drop-in removed" if any(u.part == "dropin" for u in left) else None)
        if cluster:
            with stage("cluster"):
                install_cluster(settings, gpu, cluster, targets)
        with stage("undo"):            # after the units stopped reading them: keys, trackers, the hub's parts
            undo_unwanted(settings, ("trackers", "hub", "copy"), bool(cluster), worker, hosts)
        note_plan(train_settings, gpu.target, targets)


# every host of the run, all at once, before any host changes: the inventory's values and what each
# box tells (GPU, driver, disk, the plan, verl's own checks); an inventory problem stops the whole run,
# a box's problem refuses that box (and its Ray cluster's other members) while the other hosts go on
if check_run():
    provision()
