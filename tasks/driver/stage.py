"""Stage: the NVIDIA driver, before CUDA. ``driver = "check"`` (the default) leaves it to the CUDA
stage's check (a driver older than CUDA 11.8 needs is refused there) and asks the box one command:
whether the stage left its hold and pin there, from an earlier ``driver = "install"`` (then released,
the driver kept: tasks/driver/release.py); ``driver = "install"`` chooses, installs, holds and proves it.

The choice (``choose_branch``, pure): the newest branch of the box's distro (files/drivers.toml)
that supports every GPU of the box and CUDA 11.8: never past R580 for Maxwell, Pascal and Volta;
a GPU the pinned stack cannot run at all (Kepler: R470 is its last; Blackwell) is refused in
tasks/gpu_support.py's words, the architectures and their last branches being its table. The GPUs
come from the host's GPU fact (nvidia-smi), else from the PCI bus (lspci's chip codes: a box
without a working driver), else from ``gpu_override``.

The install (``verl_lab_box/nvidia_driver.py``, run on the box): the distro's own packages
(Debian 12: non-free ``nvidia-driver``; Ubuntu 22.04/24.04: the headless members of the
``nvidia-driver-NNN-server`` family) with the running kernel's headers for DKMS, after apt's
``--simulate`` resolved them and showed only the chosen branch; the packages built from the
driver's source package held (``apt-mark hold``) and pinned at the installed version
(``/etc/apt/preferences.d/verl-lab-nvidia-driver``, priority 1001), so unattended upgrades
cannot replace the user-space libraries under the loaded module; nouveau blacklisted.

Then the installed module must run: loaded already, or loaded now by modprobe when nothing holds
the GPU, or after a reboot (another nvidia module or nouveau holds it). A reboot happens only with
``driver_reboot = true``, one box at a time (``_serial``), never while the training unit is active;
the stage waits for the box to come back. The proof (``nvidia_driver.py prove``):
/proc/driver/nvidia/version and nvidia-smi say the installed version; only then is
``markers/driver.done`` written. A box that needs a reboot without ``driver_reboot`` fails with
that reason (the packages are installed and held; a re-run after the reboot proves it).

Refused before anything changes: an unknown distro, Secure Boot on (DKMS's module is unsigned),
a GPU no allowed branch supports, a driver from NVIDIA's .run installer, driver packages of
another branch held by someone else.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.facts.server import LinuxDistribution
from pyinfra.operations import server

from tasks.catalog import REPO_ROOT
from tasks.driver.choice import gpus_seen
from tasks.driver.plan import (
    BLACKLIST,
    BLACKLIST_FILE,
    PIN_FILE,
    SOURCES_FILE,
    DriverFacts,
    DriverPlan,
    DriverWant,
    driver_want,
    initramfs_rebuild,
    plan_driver,
    refusal_text,
)
from tasks.driver.release import plan_release, stage_paths
from tasks.driver.settle import settle_driver
from tasks.driver.status import driver_notes
from tasks.facts.bundle import ask
from tasks.facts.driver import DriverLeft, DriverState
from tasks.facts.files import Marker, PathStates
from tasks.failure import fail_host
from tasks.placed import OnBox, marker_command, place, wanted_dir, wanted_file
from tasks.settings import LabSettings
from tasks.target import HostTarget

BOX_PACKAGE = REPO_ROOT / "verl_lab_box"
# the box program's sibling modules, placed beside it under their own names
BOX_MODULES = ("nvidia_driver_state.py", "nvidia_driver_apt.py", "nvidia_driver_log.py", "nvidia_driver_units.py",
               "nvidia_driver_job.py", "nvidia_driver_install.py", "nvidia_driver_hold.py")


# ---------------------------------------------------------------- pyinfra


def placed_files(want: DriverWant, plan: DriverPlan) -> list:
    files = [wanted_dir(f"{want.lab_root}/libexec"), wanted_dir(want.libexec, mode="700"),
             wanted_file(f"{want.libexec}/nvidia_driver.py", "driver stage program",
                         (BOX_PACKAGE / "nvidia_driver.py").read_bytes(), mode="700"),
             wanted_file(f"{want.libexec}/verl_lab_gpu.py", "GPU reader beside it",
                         (BOX_PACKAGE / "gpu.py").read_bytes()),
             *(wanted_file(f"{want.libexec}/{name}", f"driver stage program's {name}", (BOX_PACKAGE / name).read_bytes())
               for name in BOX_MODULES),
             wanted_file(want.plan_path, "driver plan", json.dumps(plan.box_plan, indent=1, sort_keys=True) + "\n",
                         mode="600"),
             wanted_file(BLACKLIST_FILE, "nouveau blacklisted", BLACKLIST)]
    if plan.sources:
        files.append(wanted_file(SOURCES_FILE, "apt components of the NVIDIA driver", plan.sources))
    return files


def gather_facts(settings: LabSettings, want: DriverWant, gpu: HostTarget) -> DriverFacts:
    """One command: the distro, the driver fact, the marker and the placed files' states."""
    paths = [f"{want.lab_root}/libexec", want.libexec, f"{want.libexec}/nvidia_driver.py",
             f"{want.libexec}/verl_lab_gpu.py", *(f"{want.libexec}/{name}" for name in BOX_MODULES),
             want.plan_path, BLACKLIST_FILE, SOURCES_FILE]
    distro, state, marker, states = ask(
        (LinuxDistribution, {}), (DriverState, {"pin": PIN_FILE, "units": list(want.units), "skip_sources": SOURCES_FILE,
                                          "watch": want.table.watch()}),
        (Marker, {"path": want.marker}), (PathStates, {"paths": paths}))
    state = state or DriverState.default()
    gpus, source = gpus_seen(gpu.inventory, state.get("pci") or (), settings.gpu_override)
    return DriverFacts(os_release=(distro or {}).get("release_meta") or {}, state=state, gpus=gpus, gpus_from=source,
                       marker=marker, paths=states or {})


def held_driver_notes(settings: LabSettings) -> list[str]:
    """For the status (deploy/status.py): what driver_notes says of this box's held driver; reads only."""
    want = driver_want(settings)
    distro, state = ask((LinuxDistribution, {}), (DriverState, {"pin": PIN_FILE, "units": list(want.units),
                                                                "skip_sources": SOURCES_FILE,
                                                                "watch": want.table.watch()}))
    os_release = (distro or {}).get("release_meta") or {}
    return driver_notes(state or DriverState.default(), want.table.distro(os_release))


def release_driver(settings: LabSettings, gpu: HostTarget, found: tuple | None = None) -> HostTarget:
    """``driver = "check"``: what the stage left on this box released, an operation each saying what and why, the
    driver kept (tasks/driver/release.py); refused, nothing changed, while a driver change runs or stopped
    part-way. ``found``: (``DriverLeft``, the paths' states) asked already (deploy/full.py: in the undo stage's
    bundle, tasks/undo.py ``driver_found``); else one command asks them. A box the stage never managed gets no
    operation."""
    want = driver_want(settings)
    left, states = found or ask((DriverLeft, {"pin": PIN_FILE, "units": list(want.units)}),
                                (PathStates, {"paths": stage_paths(want)}))
    release = plan_release(settings.host, want, left or DriverLeft.default(), states or {})
    if release.refusal:
        fail_host(name="NVIDIA driver: the driver stage's hold and pin are not released (nothing changed)",
                  message=release.refusal)
        return replace(gpu, refused=release.refusal)      # deploy/full.py queues nothing after it
    if release.kept:
        host.log_styled(f"verl-lab: {release.kept}", log_func=logger.info)
    for step in release.steps:
        server.shell(name=step.name, commands=list(step.commands))
    return gpu


@deploy("NVIDIA driver")
def install_driver(settings: LabSettings, gpu: HostTarget, found: tuple | None = None) -> HostTarget:
    """With ``driver = "install"``: choose, install, hold and prove the NVIDIA driver; return the
    host's target with the driver stage's result (the CUDA stage then trusts the proven driver). With
    ``driver = "check"``: ``release_driver`` (``found``: its facts, asked already)."""
    if settings.driver != "install":
        return release_driver(settings, gpu, found)
    want = driver_want(settings)
    facts = gather_facts(settings, want, gpu)
    plan = plan_driver(want, facts)
    if plan.action == "refuse":
        text = refusal_text(settings.host, plan.problems)
        fail_host(name="NVIDIA driver pre-checks failed (nothing changed)", message=text)
        return replace(gpu, refused=text)          # deploy/full.py queues nothing after it
    managed = replace(gpu, driver_stage=f"R{plan.choice.branch.branch}, installed and proven by the driver stage "
                                        "before this stage runs")
    placed = place(placed_files(want, plan), dict(facts.paths))     # a proven box too: a removed blacklist comes back
    if initramfs_rebuild(placed, plan.action):
        server.shell(name="NVIDIA driver: nouveau blacklisted: rebuild the initramfs",
                     commands=["if command -v update-initramfs >/dev/null; then update-initramfs -u; fi"])
    q = shlex.quote
    run = f"{q(want.python)} {q(want.program)} {{}} --plan {q(want.plan_path)}"
    if plan.unmask:                                 # what an earlier run that ended badly left masked
        server.shell(name=f"NVIDIA driver: unmask {' '.join(plan.unmask)} (left masked by an earlier driver change)",
                     commands=[run.format("unmask")])
    if plan.action == "done":
        host.noop(plan.reason)
        return managed
    for note in driver_notes(facts.state, plan.distro):
        logger.warning(f"[{settings.host}] verl-lab {note}")
    if plan.action == "install":
        server.shell(name=f"NVIDIA driver: install {plan.choice.reason}", commands=[run.format("install")])
    elif plan.action == "follow":                  # the box program follows the running job (it starts none)
        server.shell(name=f"NVIDIA driver: {plan.reason}", commands=[run.format("install")])
    elif plan.action == "update":
        server.shell(name=f"NVIDIA driver: update {plan.reason}", commands=[run.format("install")])
    elif plan.action == "headers":
        server.shell(name=f"NVIDIA driver: {plan.reason}", commands=[run.format("headers")])
    elif plan.action == "hold":
        server.shell(name=f"NVIDIA driver: {plan.reason}", commands=[run.format("hold")])
    settle_driver(name=f"NVIDIA driver: load R{plan.choice.branch.branch} (reboot: "
                       f"{'allowed' if want.reboot else 'not allowed'})",
                  python=want.python, program=want.program, plan_path=want.plan_path, reboot=want.reboot,
                  _serial=True)
    marker = marker_command(want.marker, [
        ("stage", "driver"), ("branch", str(plan.choice.branch.branch)), ("version", OnBox("$v")),
        ("source", plan.choice.branch.source), ("distro", plan.distro.name),
        ("written", OnBox("$(date -u +%Y-%m-%dT%H:%M:%SZ)"))])
    server.shell(name="NVIDIA driver: prove (/proc/driver/nvidia/version, nvidia-smi) and mark",
                 commands=[f"v=$({run.format('prove')}) && {marker}"])
    if gpu.target is None:
        text = (f"verl-lab driver: {settings.host}: the NVIDIA driver is installed and proven; the GPU list every "
                "later stage plans for is read once, before the stages, when this box had no working driver: re-run "
                "the deploy to provision the rest for its GPUs")
        fail_host(name="GPUs are read before the stages", message=text)
        return replace(managed, refused=text)
    return managed
