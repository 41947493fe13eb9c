"""The driver fact: what the driver stage (``driver = "install"``) decides from, in one command.

The command and its parser are box-side code (``verl_lab_box/nvidia_driver_state.py``; ``nvidia_driver.py`` reads
the box the same way when its ``verdict`` runs there); this module is the pyinfra fact around them.
"""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase

from verl_lab_box.nvidia_driver_state import JOB_UNIT, MASK_DIR, fact_command, parse_fact_output, split_sections
from verl_lab_box.nvidia_driver_units import RECORD

DPKG_UPDATES = "/var/lib/dpkg/updates"     # files there: a dpkg run that was interrupted


class DriverState(FactBase[dict]):
    """The NVIDIA driver side of a box: the running kernel, Secure Boot, signs of NVIDIA's .run
    installer, the installed NVIDIA packages (name, source package, version, installed, held; a package of
    another architecture than dpkg's own named with it, ``libcuda1:i386``, as apt names it), the
    stage's apt pin (``pin``), the loaded module (/proc/driver/nvidia/version), nouveau, the module
    built for the running kernel (modinfo) and DKMS's status, the NVIDIA display controllers on
    the PCI bus (lspci, or sysfs ids) and its NVSwitches, the state of ``units`` (the training and
    Ray units) and of the stage's apt job unit, the stage's own masks of ``units``, the processes
    holding /dev/nvidia* (with the cgroup each runs in), the kernel's lockdown mode, the Origin of each apt
    list, the archive's versions (``apt-cache madison``) of ``watch`` and of every installed NVIDIA
    DKMS package, and the text of each apt sources file but ``skip_sources`` (the stage's own)::

        {"kernel": "6.1.0-26-amd64", "secure_boot": {"state": "disabled", "said": "SecureBoot disabled"},
         "runfile": {"uninstaller": None, "installer_version": None, "libs": {path: owner package or None}},
         "packages": [{"name", "source", "version", "installed", "held", "status": "ii"}],
         "pin": {"packages", "version"} | None,
         "loaded": "535.261.03" | None, "nouveau": False, "built": {"module", "version"} | None,
         "dkms": [lines], "pci": [{"slot", "name", "device"}], "nvswitches": [{"slot", "name", "device"}],
         "units": {unit: {"load", "active", "sub", "file"}}, "masks": [unit],
         "busy": [[pid, comm, cgroup]], "lockdown": "integrity" | None,
         "origins": {"deb.debian.org_debian_dists_bookworm": "Debian"},
         "archive": {package: [{"version", "from"}]}, "sources": {path: text}}

    The default (no output): nothing known, the same dict with empty values.
    """

    @staticmethod
    def default() -> dict:
        return parse_fact_output("")

    def command(self, pin: str, units: list[str] | tuple[str, ...], skip_sources: str = "",
                watch: list[str] | tuple[str, ...] = ()) -> str:
        return fact_command(pin, tuple(units), skip_sources, tuple(watch))

    def process(self, output) -> dict:
        return parse_fact_output("\n".join(output))


class DriverMasks(FactBase[dict]):
    """For the doctor: each of ``units`` the driver stage masked (a ``/dev/null`` link in
    ``/run/systemd/system.control``), as systemd reports it, and whether the stage's apt job still
    runs: ``{"driver masks": text}`` (``systemctl is-enabled``'s word, the job's state, and
    ``systemctl status``'s Loaded line, all real systemd output); the default (no output, none
    masked): {}."""

    default = dict

    def command(self, units: list[str] | tuple[str, ...]) -> str:
        q = shlex.quote
        parts = []
        for unit in units:
            u = q(unit)
            parts.append(f"if [ \"$(readlink {q(MASK_DIR + '/' + unit)})\" = /dev/null ]; then "
                         f"echo \"{unit}: $(systemctl is-enabled {u} 2>&1) ({MASK_DIR}/{unit} -> /dev/null), the driver "
                         f"job {JOB_UNIT} $(systemctl is-active {JOB_UNIT} 2>&1)\"; "
                         f"systemctl status --no-pager {u} 2>&1 | grep -m1 'Loaded:'; fi")
        return "; ".join(parts) + "; true"

    def process(self, output) -> dict:
        text = "\n".join(line for line in output if line.strip())
        return {"driver masks": text} if text else {}


class DriverLeft(FactBase[dict]):
    """For ``driver = "check"`` (tasks/driver/release.py): what the driver stage left on a box and whether a
    driver change runs or stopped part-way, in one command: the NVIDIA packages and the stage's pin (as
    ``DriverState`` reads them), its apt job unit's state, its masks of ``units`` and its record of them
    (``RECORD``: only those are the stage's), and what dpkg left in /var/lib/dpkg/updates (an interrupted run)::

        {"packages": [{"name", "source", "version", "installed", "held", "status"}],
         "pin": {"packages", "version", "stanzas"} | None, "job": "inactive", "masks": [unit],
         "recorded": [unit], "dpkg_updates": [file]}

    The default (no output): nothing left, no job running, the same dict with empty values.
    """

    @staticmethod
    def default() -> dict:
        return DriverLeft().process([])

    def command(self, pin: str, units: list[str] | tuple[str, ...]) -> str:
        return fact_command(pin, tuple(units), only=("packages", "pin", "units", "masks"),
                            extra=(("recorded", f"cat {RECORD}"), ("dpkgupdates", f"ls -A {DPKG_UPDATES}")))

    def process(self, output) -> dict:
        text = "\n".join(output)
        state, (sections, _) = parse_fact_output(text), split_sections(text)

        def lines(name):
            return [line.strip() for line in sections.get(name, []) if line.strip()]

        return {"packages": state["packages"], "pin": state["pin"],
                "job": (state["units"].get(JOB_UNIT) or {}).get("active") or "inactive", "masks": state["masks"],
                "recorded": lines("recorded"), "dpkg_updates": lines("dpkgupdates")}
