"""The NVIDIA driver of a box: read, installed from the distro's archive, held, loaded, proven.

The driver stage (tasks/driver.py, ``driver = "install"``) ships this file as it is to
``<lab_root>/libexec/driver/nvidia_driver.py`` (with ``gpu.py`` beside it as ``verl_lab_gpu.py``)
and runs it as root with the box's python3, reading the stage's ``driver-plan.json`` beside it::

    nvidia_driver.py install --plan P   # apt-get update; apt's --simulate must resolve and bring
                                        # only the chosen branch; install; hold and pin
    nvidia_driver.py hold --plan P      # apt-mark hold and the apt preferences pin, for what is
                                        # installed from the branch's source package
    nvidia_driver.py verdict --plan P   # JSON: the installed driver is loaded, loadable now,
                                        # waiting for a reboot, or has no module for this kernel
    nvidia_driver.py load --plan P      # modprobe nvidia (verdict "load" only)
    nvidia_driver.py prove --plan P     # /proc/driver/nvidia/version and nvidia-smi say the
                                        # installed version; prints it

What a box has now is one shell command (``fact_command``) whose output ``parse_fact_output``
reads: the pyinfra fact ``tasks.facts.driver.DriverState`` runs the same pair on the controller's
behalf, and ``verdict`` here reads the box through them too. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PROC_VERSION = "/proc/driver/nvidia/version"
NOUVEAU = "/sys/module/nouveau"
RUNFILE_UNINSTALLER = "/usr/bin/nvidia-uninstall"
RUNFILE_LOG = "/var/log/nvidia-installer.log"
EFI_SECURE_BOOT = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
USER_LIBS = ("libcuda.so.1", "libnvidia-ml.so.1")
MODULE_NAMES = ("nvidia-current", "nvidia")   # Debian builds nvidia-current (modprobe nvidia installs it)
DISPLAY_CLASSES = ("0300", "0302", "0380")    # VGA, 3D and other display controllers
SECTION = "@@verl-lab-driver@@ "
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive", "NEEDRESTART_MODE": "l", "LC_ALL": "C"}
APT_INSTALL = ("apt-get", "install", "--no-install-recommends",
               "-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold")


# ---------------------------------------------------------------- what the box has (one command)


def fact_command(pin: str, unit: str, skip_sources: str = "") -> str:
    """One POSIX shell command printing every section ``parse_fact_output`` reads; always exits 0."""
    q = shlex.quote
    s = SECTION

    def section(name: str, body: str) -> str:
        return f"echo '{s}{name}'; {{ {body}; }} 2>/dev/null"

    efi = q(EFI_SECURE_BOOT)
    libs = " ".join(USER_LIBS)
    parts = [
        section("kernel", "uname -r"),
        section("secureboot", "if command -v mokutil >/dev/null; then mokutil --sb-state 2>&1; "
                              f"elif [ -r {efi} ]; then echo \"efivar $(od -An -t u1 -j4 -N1 {efi} | tr -d ' ')\"; "
                              "elif [ -d /sys/firmware/efi ]; then echo efi; else echo no-efi; fi"),
        section("runfile", f"[ -e {RUNFILE_UNINSTALLER} ] && echo 'uninstaller {RUNFILE_UNINSTALLER}'; "
                           f"[ -f {RUNFILE_LOG} ] && head -n 3 {RUNFILE_LOG} | sed 's/^/log /'; "
                           f"for lib in {libs}; do p=$(ldconfig -p | awk -v l=$lib '$1 == l {{print $NF; exit}}'); "
                           "[ -n \"$p\" ] || continue; r=$(readlink -f \"$p\"); "
                           "o=$(dpkg -S \"$r\" 2>/dev/null | head -n 1 | cut -d: -f1); echo \"lib $r ${o:-none}\"; done"),
        section("packages", "dpkg-query -W -f='${Package}\\t${source:Package}\\t${Version}\\t${db:Status-Abbrev}\\n'"
                            " | grep -i nvidia"),
        section("headers", "dpkg-query -W -f='${db:Status-Abbrev}\\n' \"linux-headers-$(uname -r)\""),
        section("pin", f"cat {q(pin)}"),
        section("loaded", f"cat {PROC_VERSION}"),
        section("nouveau", f"[ -d {NOUVEAU} ] && echo loaded"),
        section("built", f"for m in {' '.join(MODULE_NAMES)}; do v=$(modinfo -F version $m) && "
                         "{ echo \"$m $v\"; break; }; done"),
        section("dkms", "dkms status"),
        section("pci", "if command -v lspci >/dev/null; then lspci -nn -d 10de:; else "
                       "for d in /sys/bus/pci/devices/*; do [ \"$(cat $d/vendor)\" = 0x10de ] && "
                       "echo \"sysfs ${d##*/} $(cat $d/class) $(cat $d/device)\"; done; fi"),
        section("unit", f"systemctl is-active {q(unit)}"),
    ]
    skip = f" && [ \"$f\" != {q(skip_sources)} ]" if skip_sources else ""
    parts.append(f"for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; "
                 f"do [ -f \"$f\" ]{skip} || continue; echo \"{s}source $f\"; cat \"$f\"; done")
    return "; ".join(parts) + "; true"


_VERSION_LINE = re.compile(r"^installer version:\s*(\S+)")
_PCI_LINE = re.compile(r"^(?P<slot>\S+) .*\[(?P<cls>[0-9a-f]{4})\]: NVIDIA Corporation (?P<name>.*?) "
                       r"\[10de:(?P<device>[0-9a-f]{4})\]")


def parse_fact_output(text: str) -> dict:
    """What ``fact_command`` printed -> a plain dict (see ``tasks.facts.driver.DriverState``)."""
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
    for line in sections.get("packages", []):
        fields = line.split("\t")
        if len(fields) == 4 and fields[0]:
            name, source, version, status = fields
            packages.append({"name": name, "source": source or name, "version": version,
                             "installed": status[1:2] == "i", "held": status[:1] == "h"})
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
        "unit_active": (lines("unit") or [""])[0] == "active",
        "sources": {path: "\n".join(body) for path, body in sources.items()},
    }


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


def parse_pci(lines: list[str]) -> list[dict]:
    """NVIDIA display controllers from ``lspci -nn -d 10de:`` (or sysfs ids where lspci is missing):
    [{"slot", "name" (pci.ids' "GP102GL [Tesla P40]", or "Device" when pci.ids does not know it),
    "device": "1b38"}]; audio and USB functions of a card are left out."""
    found = []
    for line in lines:
        if line.startswith("sysfs "):
            _, slot, cls, device = (line.split() + ["", "", ""])[:4]
            if cls[2:6] in DISPLAY_CLASSES:
                found.append({"slot": slot, "name": None, "device": device[2:].lower()})
            continue
        m = _PCI_LINE.match(line)
        if m and m.group("cls") in DISPLAY_CLASSES:
            found.append({"slot": m.group("slot"), "name": m.group("name"), "device": m.group("device")})
    return found


def parse_pin(text: str) -> dict | None:
    """The stage's apt preferences file -> {"packages": [...], "version": "535.261.03-1"}, or None."""
    packages, version = [], None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Package":
            packages += value.split()
        elif key.strip() == "Pin" and value.strip().startswith("version "):
            version = value.strip()[len("version "):].strip()
    return {"packages": packages, "version": version} if packages and version else None


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


# ---------------------------------------------------------------- acting on the box (root)


def read_box(plan: dict) -> dict:
    out = subprocess.run(["sh", "-c", fact_command(plan["pin"], plan["unit"])], capture_output=True, text=True)
    return parse_fact_output(out.stdout)


class Failed(RuntimeError):
    """A step that cannot go on: the message says what was found and what to do."""


class Log:
    """Every step's output, to stdout and appended to the stage log (read by the doctor)."""

    def __init__(self, path: str | None, stream=None):
        self.fh, self.stream = None, stream or sys.stdout
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.fh = open(path, "a", encoding="utf-8")

    def say(self, text: str, stream=None) -> None:
        for line in text.rstrip("\n").splitlines():
            print(line, file=stream or self.stream, flush=True)
            if self.fh:
                self.fh.write(line + "\n")
                self.fh.flush()

    def run(self, argv, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        self.say("+ " + shlex.join(argv))
        res = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})})
        self.say(res.stdout + res.stderr)
        if check and res.returncode != 0:
            raise Failed(f"`{shlex.join(argv)}` exited {res.returncode}: "
                         + " ".join(line for line in (res.stdout + res.stderr).splitlines() if line.startswith("E:"))[:600])
        return res


_INST = re.compile(r"^Inst (\S+) (?:\[\S+\] )?\((\S+) ")


def simulated(text: str) -> dict[str, str]:
    """``apt-get install --simulate`` -> {package: version it would install}."""
    return {m.group(1): m.group(2) for m in map(_INST.match, text.splitlines()) if m}


def foreign_branch(would: dict[str, str], branch: int) -> list[str]:
    """The NVIDIA driver packages apt would install from another branch than ``branch`` (a package
    of the chosen name that now depends on a newer branch, as archives do with retired branches)."""
    wrong = []
    for name, version in sorted(would.items()):
        got = branch_of(version)
        if ("nvidia" in name or name.startswith("libcuda")) and got is not None and got >= 300 and got != branch:
            wrong.append(f"{name} {version}")
    return wrong


def do_install(plan: dict, log: Log) -> None:
    old = parse_pin(_read(plan["pin"]))
    if old:
        log.run(["apt-mark", "unhold", *old["packages"]], check=False)
        os.remove(plan["pin"])
        log.say(f"released the previous hold and pin ({old['version']}) to install branch {plan['branch']}")
    log.run(["apt-get", "update"], env=APT_ENV)
    wanted = [*plan["packages"], *plan["headers"]]
    res = log.run([*APT_INSTALL, "--simulate", *wanted], check=False, env=APT_ENV)
    if res.returncode != 0:
        errors = " ".join(line for line in (res.stdout + res.stderr).splitlines() if line.startswith("E:"))
        raise Failed(f"apt cannot install {' '.join(wanted)} from this box's archive ({errors or 'see the log'}); "
                     f"nothing was installed. A missing {plan['headers'][0]} means the running kernel is not one of "
                     f"{plan['distro']}'s: boot a kernel of the distro's archive (its headers let DKMS build the module)")
    wrong = foreign_branch(simulated(res.stdout), plan["branch"])
    if wrong:
        raise Failed(f"the archive's packages for branch {plan['branch']} would install another branch: "
                     f"{', '.join(wrong)}; nothing was installed. Branch {plan['branch']} was chosen for "
                     f"{plan['chosen_for']}: install the driver yourself and keep driver = 'check'")
    log.run(["apt-get", "-y", *APT_INSTALL[1:], *wanted], env=APT_ENV)
    do_hold(plan, log)
    if subprocess.run(["sh", "-c", "command -v update-initramfs"], capture_output=True).returncode == 0:
        log.run(["update-initramfs", "-u"], check=False)     # the nouveau blacklist, also at early boot


def do_hold(plan: dict, log: Log) -> None:
    state = read_box(plan)
    pkgs = installed_from(state, plan["source"])
    versions = sorted({p["version"] for p in pkgs})
    if len(versions) != 1:
        raise Failed(f"the packages of {plan['source']} installed here are at {', '.join(versions) or 'no version'}: "
                     "expected one version of the branch; nothing was held")
    names = sorted({p["name"] for p in pkgs})
    log.run(["apt-mark", "hold", *names])
    text = pin_text(names, versions[0], plan)
    part = plan["pin"] + ".part"
    with open(part, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(part, 0o644)
    os.replace(part, plan["pin"])
    log.say(f"held {len(names)} packages of {plan['source']} at {versions[0]} (apt-mark hold, {plan['pin']})")


def pin_text(names: list[str], version: str, plan: dict) -> str:
    return (f"# verl-lab driver stage: NVIDIA driver branch {plan['branch']} ({plan['source']} {version}),\n"
            f"# chosen for {plan['chosen_for']}. The packages are also held (apt-mark hold), so neither\n"
            "# unattended-upgrades nor apt upgrade replaces the user-space libraries under the loaded module.\n"
            "# To change the driver: re-run the driver stage, or apt-mark unhold them and remove this file.\n"
            f"Package: {' '.join(names)}\nPin: version {version}\nPin-Priority: 1001\n")


def do_prove(plan: dict, log: Log) -> str:
    state = read_box(plan)
    v = verdict(state, plan["module_package"])
    if v["verdict"] != "loaded":
        raise Failed(f"the driver is not loaded: {v['reason']}")
    installed = v["installed"]
    log.say(f"ok    {PROC_VERSION}: {installed}")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    rows = [line.split(", ") for line in smi.stdout.splitlines() if line.strip()]
    if smi.returncode != 0 or not rows:
        raise Failed(f"nvidia-smi failed (exit {smi.returncode}): {(smi.stdout + smi.stderr).strip()[:300]}")
    other = [r for r in rows if r[-1].strip() != installed]
    if other:
        raise Failed(f"nvidia-smi reports driver {other[0][-1].strip()} for GPU {other[0][0]}, not {installed}")
    log.say(f"ok    nvidia-smi: {len(rows)} GPU(s), driver {installed}")
    return installed


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return ""


def _gpu():
    """gpu.py: the package's sibling in the repo, ``verl_lab_gpu.py`` beside this file on a box."""
    try:
        from verl_lab_box import gpu
    except ImportError:
        sys.path.insert(0, HERE)
        import verl_lab_gpu as gpu
    return gpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("install", "hold", "verdict", "load", "prove"))
    parser.add_argument("--plan", required=True, help="driver-plan.json written by the driver stage")
    args = parser.parse_args(argv)
    with open(args.plan, encoding="utf-8") as fh:
        plan = json.load(fh)
    # prove prints only the version on stdout (the marker reads it): its report goes to stderr
    log = Log(plan.get("log") if args.command != "verdict" else None,
              sys.stderr if args.command == "prove" else None)
    try:
        if args.command == "install":
            do_install(plan, log)
        elif args.command == "hold":
            do_hold(plan, log)
        elif args.command == "verdict":
            print(json.dumps(verdict(read_box(plan), plan["module_package"])))
        elif args.command == "load":
            log.run(["modprobe", "nvidia"])
            log.run(["modprobe", "nvidia-uvm"], check=False)
        else:
            print(do_prove(plan, log))
    except Failed as exc:
        log.say(f"verl-lab driver: {exc}", sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
