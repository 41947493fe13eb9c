"""What a box has on the NVIDIA driver side, read by one shell command, and what is decided from it
on the box too (the load verdict).

``fact_command`` prints every section ``parse_fact_output`` reads: the pyinfra fact
``tasks.facts.driver.DriverState`` runs that pair on the controller's behalf, and
``nvidia_driver.py`` (shipped with this file beside it) reads the box through them. Standard
library only.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PROC_VERSION = "/proc/driver/nvidia/version"
NOUVEAU = "/sys/module/nouveau"
RUNFILE_UNINSTALLER = "/usr/bin/nvidia-uninstall"
RUNFILE_LOG = "/var/log/nvidia-installer.log"
EFI_SECURE_BOOT = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
LOCKDOWN = "/sys/kernel/security/lockdown"
PCI_DEVICES = "/sys/bus/pci/devices"
APT_LISTS = "/var/lib/apt/lists"
USER_LIBS = ("libcuda.so.1", "libnvidia-ml.so.1")
MODULE_NAMES = ("nvidia-current", "nvidia")   # Debian builds nvidia-current (modprobe nvidia installs it)
DISPLAY_CLASSES = ("0300", "0302", "0380")    # VGA, 3D and other display controllers
NVSWITCH_CLASS = "0680"                       # "Bridge [0680]": the NVSwitches of an HGX board
SECTION = "@@verl-lab-driver@@ "
UNIT_PROPS = ("Id", "LoadState", "ActiveState", "SubState", "UnitFileState")
# where the driver stage masks a unit for the length of a driver change: a /dev/null link here outranks
# /etc/systemd/system (where the training and Ray units live), which `systemctl mask --runtime`'s
# /run/systemd/system does not; /run is emptied by every boot (nvidia_driver_units.py)
MASK_DIR = "/run/systemd/system.control"
JOB_UNIT = "verl-lab-driver-apt.service"    # the transient unit a driver change's apt runs in (nvidia_driver_job.py)
# the pin's comment naming the packages that were held before the stage held them (a user's own holds, which
# apt-mark cannot tell from the stage's once both are set): driver = "check" leaves them held
THEIRS = "# held before the driver stage held them (driver = 'check' keeps these held): "


# ---------------------------------------------------------------- what the box has (one command)


def fact_command(pin: str, units: str | tuple[str, ...] | list[str], skip_sources: str = "",
                 watch: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
                 extra: tuple[tuple[str, str], ...] = ()) -> str:
    """One POSIX shell command printing every section ``parse_fact_output`` reads; always exits 0.
    ``units``: the units no driver change may run under (the training unit, the Ray unit).
    ``watch``: packages whose archive versions (``apt-cache madison``) are read, besides every
    installed NVIDIA DKMS package. ``only``: these sections alone (``"sources"`` for the apt
    sources files), the others read as absent; ``extra``: (name, shell) sections of the caller's,
    which ``split_sections`` returns with the rest."""
    q = shlex.quote
    units = (units,) if isinstance(units, str) else tuple(units)
    named = " ".join(q(u) for u in units)
    s = SECTION

    def section(name: str, body: str) -> str:
        return f"echo '{s}{name}'; {{ {body}; }} 2>/dev/null"

    efi = q(EFI_SECURE_BOOT)
    libs = " ".join(USER_LIBS)
    watched = " ".join(q(p) for p in watch)
    parts = [
        ("kernel", "uname -r"),
        ("secureboot", "if command -v mokutil >/dev/null; then mokutil --sb-state 2>&1; "
                       f"elif [ -r {efi} ]; then echo \"efivar $(od -An -t u1 -j4 -N1 {efi} | tr -d ' ')\"; "
                       "elif [ -d /sys/firmware/efi ]; then echo efi; else echo no-efi; fi"),
        ("lockdown", f"cat {LOCKDOWN}"),
        ("runfile", f"[ -e {RUNFILE_UNINSTALLER} ] && echo 'uninstaller {RUNFILE_UNINSTALLER}'; "
                    f"[ -f {RUNFILE_LOG} ] && head -n 3 {RUNFILE_LOG} | sed 's/^/log /'; "
                    f"for lib in {libs}; do p=$(ldconfig -p | awk -v l=$lib '$1 == l {{print $NF; exit}}'); "
                    "[ -n \"$p\" ] || continue; r=$(readlink -f \"$p\"); "
                    "o=$(dpkg -S \"$r\" 2>/dev/null | head -n 1 | cut -d: -f1); echo \"lib $r ${o:-none}\"; done"),
        # ${binary:Package}: a package of another architecture than dpkg's own (libcuda1:i386 beside libcuda1 on a
        # multiarch box) is a package of its own, named with its architecture (parse_fact_output's names)
        ("packages", "echo \"arch $(dpkg --print-architecture)\"; "
                     "dpkg-query -W -f='${binary:Package}\\t${source:Package}\\t${Version}\\t${db:Status-Abbrev}\\n'"
                     " | grep -i nvidia"),
        ("headers", "dpkg-query -W -f='${db:Status-Abbrev}\\n' \"linux-headers-$(uname -r)\""),
        ("pin", f"cat {q(pin)}"),
        ("loaded", f"cat {PROC_VERSION}"),
        ("nouveau", f"[ -d {NOUVEAU} ] && echo loaded"),
        ("built", f"for m in {' '.join(MODULE_NAMES)}; do v=$(modinfo -F version $m) && "
                  "{ echo \"$m $v\"; break; }; done"),
        ("dkms", "dkms status"),
        ("pci", "if command -v lspci >/dev/null; then lspci -nn -d 10de:; else "
                f"for d in {PCI_DEVICES}/*; do [ \"$(cat $d/vendor)\" = 0x10de ] && "
                "echo \"sysfs ${d##*/} $(cat $d/class) $(cat $d/device)\"; done; fi"),
        # each unit's state (any but inactive or failed is busy: "activating (auto-restart)" restarts a
        # job within RestartSec), the driver stage's own masks of them, and its apt job
        ("units", f"systemctl show {' '.join('-p ' + p for p in UNIT_PROPS)} {named} {JOB_UNIT}"),
        ("masks", f"for u in {named}; do [ \"$(readlink {MASK_DIR}/$u)\" = /dev/null ] && echo $u; done"),
        # processes holding the GPUs: a driver changed under them fails (NVML's version mismatch); with
        # the unit (cgroup) each runs in, which stopping that unit ends
        ("busy", "for p in /proc/[0-9]*; do for f in $p/fd/*; do case \"$(readlink $f)\" in /dev/nvidia*) "
                 "printf '%s %s\\t%s\\n' \"${p#/proc/}\" \"$(cat $p/comm)\" \"$(sed -n 's/^0:://p' $p/cgroup)\"; "
                 "break;; esac; done; done"),
        ("origins", f"grep -H '^Origin:' {APT_LISTS}/*Release"),
        ("madison", f"apt-cache madison {watched} $(dpkg-query -W -f='${{Package}} ${{db:Status-Abbrev}}\\n' "
                    "| awk '$2 ~ /^.i/ && $1 ~ /nvidia/ && $1 ~ /dkms/ {print $1}')"),
        *extra,
    ]
    names = None if only is None else {*only, *(name for name, _ in extra)}
    out = [section(name, body) for name, body in parts if names is None or name in names]
    skip = f" && [ \"$f\" != {q(skip_sources)} ]" if skip_sources else ""
    if only is None or "sources" in only:
        out.append(f"for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; "
                   f"do [ -f \"$f\" ]{skip} || continue; echo \"{s}source $f\"; cat \"$f\"; done")
    return "; ".join(out) + "; true"


_VERSION_LINE = re.compile(r"^installer version:\s*(\S+)")
_PCI_LINE = re.compile(r"^(?P<slot>\S+) .*\[(?P<cls>[0-9a-f]{4})\]: NVIDIA Corporation (?P<name>.*?) "
                       r"\[10de:(?P<device>[0-9a-f]{4})\]")


def split_sections(text: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """What ``fact_command`` printed -> ({section: its lines}, {apt sources file: its lines})."""
    sections: dict[str, list[str]] = {}
    sources: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(SECTION):
            name = line[len(SECTION):].strip()
            if name.startswith("source "):
                current = sources.setdefault(name[len("source "):], [])
            else:
                current = sections.setdefault(name, [])
        elif current is not None:
            current.append(line)
    return sections, sources


def parse_fact_output(text: str) -> dict:
    """What ``fact_command`` printed -> a plain dict (see ``tasks.facts.driver.DriverState``)."""
    sections, sources = split_sections(text)

    def lines(name):
        return [line.strip() for line in sections.get(name, []) if line.strip()]

    runfile = {"uninstaller": None, "installer_version": None, "libs": {}}
    for line in lines("runfile"):
        kind, _, rest = line.partition(" ")
        if kind == "uninstaller":
            runfile["uninstaller"] = rest
        elif kind == "log" and _VERSION_LINE.match(rest):
            runfile["installer_version"] = _VERSION_LINE.match(rest).group(1)
        elif kind == "log" and rest.startswith("nvidia-installer log file"):
            runfile["installer_version"] = runfile["installer_version"] or "unknown"
        elif kind == "lib":
            path, _, owner = rest.rpartition(" ")
            runfile["libs"][path] = None if owner == "none" else owner
    packages = []
    native = next((line.split()[1] for line in lines("packages") if line.startswith("arch ") and len(line.split()) == 2),
                  None)
    for line in sections.get("packages", []):
        fields = line.split("\t")
        if len(fields) == 4 and fields[0]:
            binary, source, version, status = fields
            name = package_name(binary, native)
            # installed: configured (i), or with triggers pending (t) or awaited (W): dpkg has configured it
            packages.append({"name": name, "source": source or name, "version": version,
                             "installed": status[1:2] in ("i", "t", "W"), "held": status[:1] == "h",
                             "status": status.strip()})
    built = (lines("built") or [""])[0].split()
    return {
        "kernel": (lines("kernel") or [None])[0],
        "secure_boot": secure_boot_state(lines("secureboot")),
        "runfile": runfile,
        "packages": packages,
        "headers_installed": (lines("headers") or [""])[0][1:2] == "i",
        "pin": parse_pin("\n".join(sections.get("pin", []))),
        "loaded": loaded_version("\n".join(sections.get("loaded", []))),
        "nouveau": "loaded" in lines("nouveau"),
        "built": {"module": built[0], "version": built[1]} if len(built) == 2 else None,
        "dkms": lines("dkms"),
        "pci": parse_pci(lines("pci")),
        "nvswitches": parse_pci(lines("pci"), (NVSWITCH_CLASS,)),
        "units": parse_units(sections.get("units", [])),
        "masks": lines("masks"),
        "busy": [[*head.split(" ", 1), *rest] for head, *rest in (line.split("\t", 1) for line in lines("busy"))],
        "lockdown": lockdown_mode(lines("lockdown")),
        "origins": parse_origins(lines("origins")),
        "archive": parse_madison(lines("madison")),
        "sources": {path: "\n".join(body) for path, body in sources.items()},
    }



def package_name(binary: str, native: str | None) -> str:
    """dpkg's ``${binary:Package}`` -> the name apt gives the package: bare for dpkg's own architecture
    (``native``) and ``all``, ``name:arch`` for another (``libcuda1:i386``), as ``apt-mark hold`` and
    ``apt-mark showhold``, the apt preferences' ``Package:`` line and apt-get's ``Inst`` lines name it. dpkg
    qualifies every ``Multi-Arch: same`` package, its own architecture's too (``libcuda1:amd64``)."""
    name, _, arch = binary.partition(":")
    return name if not arch or arch in (native, "all") else binary


def parse_units(lines: list[str]) -> dict[str, dict]:
    """``systemctl show -p Id -p LoadState ...`` of several units (blocks split by a blank line) ->
    {unit: {"load", "active", "sub", "file"}}; a unit systemd does not know reads load "not-found",
    active "inactive"."""
    found, block = {}, {}
    for line in [*lines, ""]:
        if line.strip():
            key, _, value = line.strip().partition("=")
            block[key] = value
        elif block.get("Id"):
            found[block["Id"]] = {"load": block.get("LoadState", ""), "active": block.get("ActiveState", ""),
                                  "sub": block.get("SubState", ""), "file": block.get("UnitFileState", "")}
            block = {}
    return found


def secure_boot_state(lines: list[str]) -> dict:
    """mokutil --sb-state (or the EFI variable) -> {"state": "enabled" | "disabled" | "no-efi" |
    "unknown", "said": what was read}. "SecureBoot validation is disabled in shim" loads unsigned
    modules: it counts as disabled."""
    said = " / ".join(lines)
    text = said.lower()
    if "validation is disabled in shim" in text or "secureboot disabled" in text or lines[:1] == ["efivar 0"]:
        state = "disabled"
    elif "secureboot enabled" in text or lines[:1] == ["efivar 1"]:
        state = "enabled"
    elif "doesn't support secure boot" in text or "efi variables are not supported" in text or lines == ["no-efi"]:
        state = "no-efi"
    else:
        state = "unknown"
    return {"state": state, "said": said}


def loaded_version(text: str) -> str | None:
    """The version of the loaded nvidia kernel module, from /proc/driver/nvidia/version."""
    return _gpu().parse_proc_driver_version(text)


def parse_pci(lines: list[str], classes: tuple[str, ...] = DISPLAY_CLASSES) -> list[dict]:
    """NVIDIA devices of ``classes`` (display controllers; NVSWITCH_CLASS for NVSwitches) from
    ``lspci -nn -d 10de:`` (or sysfs ids where lspci is missing): [{"slot", "name" (pci.ids'
    "GP102GL [Tesla P40]", or "Device" when pci.ids does not know it), "device": "1b38"}]; the
    other functions of a card (audio, USB) are left out."""
    found = []
    for line in lines:
        if line.startswith("sysfs "):
            _, slot, cls, device = (line.split() + ["", "", ""])[:4]
            if cls[2:6] in classes:
                found.append({"slot": slot, "name": None, "device": device[2:].lower()})
            continue
        m = _PCI_LINE.match(line)
        if m and m.group("cls") in classes:
            found.append({"slot": m.group("slot"), "name": m.group("name"), "device": m.group("device")})
    return found


def parse_pin(text: str) -> dict | None:
    """The stage's apt preferences file -> {"packages": [...], "version": "535.261.03-1" (the
    driver's, the first stanza), "stanzas": [{"packages", "version"}] (a second stanza: the Fabric
    Manager, versioned on its own), "theirs": [...] (the packages held before the stage held them,
    its ``THEIRS`` line: those holds are not the stage's to release)}, or None."""
    stanzas, packages, theirs = [], [], []
    for line in text.splitlines():
        if line.startswith(THEIRS):
            theirs += line[len(THEIRS):].split()
            continue
        key, _, value = line.partition(":")
        if key.strip() == "Package":
            packages = value.split()
        elif key.strip() == "Pin" and value.strip().startswith("version ") and packages:
            stanzas.append({"packages": packages, "version": value.strip()[len("version "):].strip()})
            packages = []
    if not stanzas:
        return None
    return {"packages": [p for s in stanzas for p in s["packages"]], "version": stanzas[0]["version"],
            "stanzas": stanzas, "theirs": theirs}


def upstream(version: str | None) -> str | None:
    """A Debian package version -> the driver version it carries ("535.261.03-1" -> "535.261.03")."""
    if not version:
        return None
    return version.split(":", 1)[-1].split("-", 1)[0].split("+", 1)[0]


def branch_of(version: str | None) -> int | None:
    m = re.match(r"^(\d+)\.", upstream(version) or "")
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------- decisions on what was read


def installed_from(state: dict, source: str) -> list[dict]:
    """The installed binary packages built from ``source``."""
    return [p for p in state.get("packages", ()) if p["source"] == source and p["installed"]]


def verdict(state: dict, module_package: str) -> dict:
    """Where the installed driver stands: {"verdict", "installed", "reason"}. verdict is one of
    missing (not installed), loaded (the running kernel has this version), load (nothing holds the
    GPU and the module exists for this kernel: modprobe loads it), reboot (another nvidia module or
    nouveau is loaded: only a reboot swaps it), no-module (DKMS built no module of this version for
    the running kernel: a reboot would not help)."""
    pkg = next((p for p in state.get("packages", ()) if p["name"] == module_package and p["installed"]), None)
    installed = upstream(pkg["version"]) if pkg else None
    loaded, nouveau, built = state.get("loaded"), state.get("nouveau"), state.get("built") or {}
    kernel = state.get("kernel") or "?"
    if not installed:
        return {"verdict": "missing", "installed": None, "reason": f"{module_package} is not installed"}
    if loaded == installed:
        return {"verdict": "loaded", "installed": installed,
                "reason": f"the running kernel has the nvidia module {installed} loaded"}
    if built.get("version") != installed:
        dkms = "; ".join(state.get("dkms") or []) or "no DKMS status"
        return {"verdict": "no-module", "installed": installed,
                "reason": (f"no nvidia kernel module {installed} exists for the running kernel {kernel} "
                           f"(modinfo found {built.get('version') or 'none'}; dkms status: {dkms}). DKMS builds it "
                           f"only with that kernel's headers (linux-headers-{kernel}): see "
                           "/var/lib/dkms/*/*/build/make.log, fix the build, and re-run")}
    if loaded is None and not nouveau:
        return {"verdict": "load", "installed": installed,
                "reason": f"the module {installed} is built for {kernel} and no driver holds the GPU: modprobe loads it"}
    holder = "nouveau" if nouveau else f"the nvidia module {loaded}"
    return {"verdict": "reboot", "installed": installed,
            "reason": f"the running kernel still has {holder} loaded: a reboot loads {installed}"}


# nvidia-persistenced keeps /dev/nvidia* open on every box that runs it (Ubuntu's nvidia-compute-utils
# starts it); it is no job, and its package restarts it with the driver. /proc's comm is 15 characters.
SYSTEM_GPU_USERS = ("nvidia-persiste",)


def gpu_users(state: dict) -> list[list[str]]:
    """The processes holding /dev/nvidia* ([pid, comm]) but the persistence daemon."""
    return [b for b in state.get("busy") or () if (b[1:] or [""])[0] not in SYSTEM_GPU_USERS]


def lockdown_mode(lines: list[str]) -> str | None:
    """/sys/kernel/security/lockdown ("none [integrity] confidentiality") -> the mode in brackets,
    or None where the kernel has no lockdown LSM."""
    m = re.search(r"\[(\w+)\]", " ".join(lines))
    return m.group(1) if m else None


def parse_origins(lines: list[str]) -> dict[str, str]:
    """``grep -H '^Origin:' /var/lib/apt/lists/*Release`` -> {list file's archive prefix: Origin}:
    {"deb.debian.org_debian_dists_bookworm": "Debian"}."""
    found = {}
    for line in lines:
        path, _, rest = line.partition(":Origin:")
        if rest:
            name = os.path.basename(path)
            found[re.sub(r"_(In)?Release$", "", name)] = rest.strip()
    return found


def parse_madison(lines: list[str]) -> dict[str, list[dict]]:
    """``apt-cache madison`` -> {package: [{"version", "from"}]}, newest first, as apt lists them."""
    found: dict[str, list[dict]] = {}
    for line in lines:
        cols = [c.strip() for c in line.split("|")]
        if len(cols) == 3 and cols[0] and cols[1]:
            entry = {"version": cols[1], "from": cols[2]}
            if entry not in found.setdefault(cols[0], []):
                found[cols[0]].append(entry)
    return found


def _gpu():
    """gpu.py: the package's sibling in the repo, ``verl_lab_gpu.py`` beside this file on a box."""
    try:
        from verl_lab_box import gpu
    except ImportError:
        sys.path.insert(0, HERE)
        import verl_lab_gpu as gpu
    return gpu
