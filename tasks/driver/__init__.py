"""The NVIDIA driver stage (docs/driver.md): with ``driver = "install"`` a box gets the newest branch of its
distro that runs every GPU and CUDA 11.8, installed from the distro's archive on an idle box, held, pinned,
loaded and proven; with ``check`` (the default) the box is asked nothing and the CUDA stage judges the driver.

What the folder decides, one module a decision, each importing only those above it:

* ``choice.py``: files/drivers.toml read into a table, the box's GPUs as the choice sees them (nvidia-smi,
  the PCI bus, ``gpu_override``) and the branch (``choose_branch``);
* ``sources.py``: the apt sources the driver packages need and the running kernel's headers;
* ``status.py``: what the status and the stage say of a held driver: a newer build, an end of life, a change
  running or left masked (``driver_notes``);
* ``plan.py``: refuse, install, hold, settle or done, from the box's driver fact (``plan_driver``);
* ``settle.py``: the execute-time step: load the module, or reboot for it one box at a time (``settle_driver``);
* ``release.py``: back to ``check`` on a box the stage managed: its hold and pin released, the driver kept, refused
  while a driver change runs or stopped part-way (``plan_release``);
* ``stage.py``: the ``@deploy`` (``install_driver``; ``held_driver_notes`` for deploy/status.py), imported by
  its path (deploy/driver.py, deploy/full.py), never here: no module below the stages imports a stage, and
  this ``__init__`` runs whenever any module of the folder is imported.

The box's side is verl_lab_box/nvidia_driver*.py (placed in ``<lab_root>/libexec/driver/``). Every public name
of the folder's modules but the stage's is handed on here, but for three of release.py's that name what they are
only beside it: its ``refusal_text`` (plan.py's is the folder's), ``Step`` and ``WHY``.
"""

from __future__ import annotations

from tasks.driver.choice import (
    DRIVERS_PATH,
    BranchChoice,
    Distro,
    DistroBranch,
    DriverTable,
    GpuSeen,
    choose_branch,
    gpus_seen,
    load_table,
)
from tasks.driver.plan import (
    BLACKLIST,
    BLACKLIST_FILE,
    FM_SERVICE,
    PIN_FILE,
    SECURE_BOOT_FIX,
    SOURCES_FILE,
    DriverFacts,
    DriverPlan,
    DriverWant,
    busy_problem,
    driver_want,
    foreign_module,
    gpus_to_check,
    initramfs_rebuild,
    job_running,
    plan_driver,
    refusal_text,
    refusals,
)
from tasks.driver.release import (
    DRIVER_SOURCES,
    Release,
    driver_packages,
    kept_line,
    leftovers_step,
    pinned,
    plan_release,
    release_step,
    stage_paths,
    unfinished,
    unmask_step,
)
from tasks.driver.settle import REBOOT_TOKEN, REBOOT_WAIT_S, reboot_and_wait, settle_driver
from tasks.driver.sources import (
    ARCHIVE_HOSTS,
    headers_packages,
    list_name,
    of_the_distro,
    parse_sources,
    sources_to_add,
)
from tasks.driver.status import change_notes, driver_notes, end_of_life_passed, held_branch, newer_build

__all__ = [
    "DRIVERS_PATH", "BranchChoice", "Distro", "DistroBranch", "DriverTable", "GpuSeen", "choose_branch", "gpus_seen",
    "load_table", "ARCHIVE_HOSTS", "headers_packages", "list_name", "of_the_distro", "parse_sources", "sources_to_add",
    "change_notes", "driver_notes", "end_of_life_passed", "held_branch", "newer_build", "BLACKLIST", "BLACKLIST_FILE",
    "FM_SERVICE", "PIN_FILE", "SECURE_BOOT_FIX", "SOURCES_FILE", "DriverFacts", "DriverPlan", "DriverWant",
    "busy_problem", "driver_want", "foreign_module", "gpus_to_check", "initramfs_rebuild", "job_running", "plan_driver",
    "refusal_text", "refusals", "REBOOT_TOKEN", "REBOOT_WAIT_S", "reboot_and_wait", "settle_driver", "DRIVER_SOURCES",
    "Release", "driver_packages", "kept_line", "leftovers_step", "pinned", "plan_release", "release_step", "stage_paths",
    "unfinished", "unmask_step",
]
