"""Stage 0: the box-side layout every later stage writes into, and the training user; and the
host's target (tasks/target.py: its GPU, and the host compiler nvcc 11.8 and Apex's build use),
read in the same command, returned to the stages; gcc-11 installed here where the box needs it."""

from __future__ import annotations

from dataclasses import replace

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.server import LinuxDistribution
from pyinfra.operations import apt, server

from tasks.facts.bundle import ask
from tasks.failure import fail_host
from tasks.facts.files import PasswdEntry, PathStates
from tasks.facts.gpu import NvidiaGpus
from tasks.facts.nvidia import CudaHostCompiler
from tasks.placed import place, wanted_dir
from tasks.plan import rollout_refusal
from tasks.settings import LabSettings
from tasks.target import HOST_COMPILER_PACKAGES, HostTarget, decide_compiler, decide_gpu

SHELL = "/usr/sbin/nologin"


@deploy("verl-lab base layout")
def base_layout(settings: LabSettings, trains: bool = True) -> HostTarget:
    """Create lab_root with its markers/ and cache/ folders, and the unprivileged training user;
    return the host's target (GPU, host compiler) for the stages after it.

    One command decides (the user's passwd entry, the folders' modes, the GPUs and driver, the
    distro and its gcc): a re-run on a box that is as it should be issues no operation at all.

    A workload the box's GPU cannot run (``workload.rollout = 'vllm'`` below compute capability
    7.0) fails the box before any operation; so, with ``trains`` (every deploy but the CUDA
    toolkit's alone), does a box whose training plan cannot exist (tasks/validation.py: an
    unsupported GPU, no GPU, a workload that does not fit or that verl refuses): only its failure
    is queued, and the target comes back with ``refused`` set: the deploy file queues nothing after it.
    """
    home = f"{settings.lab_root}/home"
    dirs = [wanted_dir(settings.lab_root), wanted_dir(settings.marker_dir),
            wanted_dir(settings.box_cache, mode="750")]
    states, entry, gpus, distro, gcc = ask((PathStates, {"paths": [home] + [d.path for d in dirs]}),
                                           (PasswdEntry, {"user": settings.train_user}), (NvidiaGpus, {}),
                                           (LinuxDistribution, {}), (CudaHostCompiler, {}))
    compiler = decide_compiler((distro or {}).get("release_meta") or {}, gcc)
    target = replace(decide_gpu(settings, gpus), compiler=compiler)
    rollout = settings.workload["rollout"]
    refusal = target.target and rollout_refusal(rollout, target.target)
    if refusal:        # before anything on this box changes (its GPU is known only now)
        message = (f"host {settings.host}: workload.rollout = {rollout!r} (GPU from {target.source}): "
                   f"{refusal[0]}. Fix: {refusal[1]}")
        fail_host(name="workload.rollout", stage="base", message=message)
        return replace(target, refused=message)
    # a box whose GPUs no driver lists yet, with driver = "install": the driver stage reads them from
    # the PCI bus, installs the driver and stops the box there ("re-run"): its plan is made then
    awaits_driver = settings.driver == "install" and target.target is None
    problem = cannot_train(settings, target) if trains and not awaits_driver else None
    if problem:
        fail_host(name="verl-lab checks: this box cannot train (nothing was changed)", message=str(problem),
                  stage="checks")
        return replace(target, refused=str(problem))
    home_state = (states or {}).get(home)
    if (entry and entry["uid"] != 0 and entry["home"] == home and entry["shell"] == SHELL
            and home_state and home_state.get("kind") == "dir" and home_state.get("user") == settings.train_user):
        host.noop(f"training user {settings.train_user} exists (uid {entry['uid']}, home {home})")
    else:
        server.user(
            name=f"Training user {settings.train_user} (unprivileged)",
            user=settings.train_user,
            system=True,
            shell=SHELL,
            home=home,
            create_home=True,
        )
    place(dirs, states or {})
    if compiler.install:
        apt.update(name="apt update (for gcc-11, the newest gcc nvcc 11.8 accepts)")
        apt.packages(name=f"Host compiler for nvcc 11.8 and the Apex build: {compiler.reason}",
                     packages=list(HOST_COMPILER_PACKAGES), no_recommends=True)
    return target


def cannot_train(settings: LabSettings, target: HostTarget):
    """Why this box cannot train, as a SettingsError (None: its plan exists): the plan alone, or
    its cluster's by every member's GPU (the other members' GPU facts, asked at prepare time)."""
    from tasks.hostdata import cluster_for, member_targets
    from tasks.validation import plan_problem

    cluster = cluster_for()
    members = member_targets(cluster, settings.host, target.target) if cluster and target.target else None
    return plan_problem(settings, target.target, target.source, target.problem, members)
