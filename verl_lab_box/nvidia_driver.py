"""The NVIDIA driver of a box: installed from the distro's archive, held, loaded, proven.

The driver stage (tasks/driver.py, ``driver = "install"``) ships this file as it is to
``<lab_root>/libexec/driver/nvidia_driver.py`` (with ``nvidia_driver_state.py``,
``nvidia_driver_apt.py`` and ``gpu.py`` as ``verl_lab_gpu.py`` beside it) and runs it as root with
the box's python3, reading the stage's ``driver-plan.json`` beside it::

    nvidia_driver.py install --plan P   # idle box only; apt-get update; apt's --simulate must resolve,
                                        # bring only the chosen branch, remove no NVIDIA package it
                                        # was not asked to replace, and the candidate's own
                                        # supported-gpus.json must list every GPU; install; hold, pin
    nvidia_driver.py headers --plan P   # the running kernel's headers alone (the driver untouched)
    nvidia_driver.py hold --plan P      # apt-mark hold and the apt preferences pin, for what is
                                        # installed from the branch's source package
    nvidia_driver.py verdict --plan P   # JSON: the installed driver is loaded, loadable now,
                                        # waiting for a reboot, or has no module for this kernel
    nvidia_driver.py load --plan P      # modprobe nvidia (verdict "load" only); Fabric Manager started
    nvidia_driver.py prove --plan P     # /proc/driver/nvidia/version and nvidia-smi say the installed
                                        # version (and cuInit succeeds on an NVSwitch box); prints it

The hold and the pin stay in place through ``apt-get update`` and the simulation; they are released
only for an install that must change held packages, and put back when that install fails. Standard
library only.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

try:
    from verl_lab_box import nvidia_driver_apt as apt
    from verl_lab_box import nvidia_driver_state as box_state
except ImportError:                     # on a box: the modules lie side by side
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import nvidia_driver_apt as apt
    import nvidia_driver_state as box_state

PROC_VERSION = box_state.PROC_VERSION
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive", "NEEDRESTART_MODE": "l", "LC_ALL": "C"}
APT_INSTALL = ("apt-get", "install", "--no-install-recommends",
               "-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold")
IDLE_FIX = ("stop training first: set train_unit_state = 'stopped' and re-run the train stage (or "
            "`systemctl stop {unit}`), then re-run the driver stage")
CUDA_ERRORS = {802: "system not ready (CUDA_ERROR_SYSTEM_NOT_READY: on an NVSwitch box, Fabric Manager has not "
                    "set up the fabric)", 100: "no CUDA-capable device", 999: "unknown error"}


# ---------------------------------------------------------------- acting on the box (root)


def read_box(plan: dict) -> dict:
    out = subprocess.run(["sh", "-c", box_state.fact_command(plan["pin"], plan["unit"])], capture_output=True, text=True)
    return box_state.parse_fact_output(out.stdout)


class Failed(RuntimeError):
    """A step that cannot go on: the message says what was found and what to do."""


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

    def run(self, argv, check: bool = True, env: dict | None = None, cwd: str | None = None
            ) -> subprocess.CompletedProcess:
        self.say("+ " + shlex.join(argv))
        res = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd)
        self.say(res.stdout + res.stderr)
        if check and res.returncode != 0:
            raise Failed(f"`{shlex.join(argv)}` exited {res.returncode}: "
                         + " ".join(line for line in (res.stdout + res.stderr).splitlines() if line.startswith("E:"))[:600])
        return res


def busy_problem(plan: dict, state: dict) -> str | None:
    """Why the driver packages must not change now: the training unit is active, or processes hold
    /dev/nvidia* (a new user-space library under their loaded module: NVML's version mismatch)."""
    unit = plan["unit"]
    if state.get("unit_active"):
        return f"{unit} is active: no driver package is changed under a running job; " + IDLE_FIX.format(unit=unit)
    users = box_state.gpu_users(state)
    if users:
        who = ", ".join(f"{b[0]} ({b[1] if len(b) > 1 else '?'})" for b in users)
        return (f"processes hold /dev/nvidia* ({who}): no driver package is changed under them; stop them, or "
                + IDLE_FIX.format(unit=unit))
    return None


def prefs_without(pin: str) -> str:
    """A copy of /etc/apt/preferences.d without the stage's own pin (for a simulation that may move
    the pinned version: an update on purpose, or another branch)."""
    tmp = tempfile.mkdtemp(prefix="verl-lab-prefs-")
    here = os.path.dirname(pin)
    for path in glob.glob(os.path.join(here, "*")):
        if os.path.abspath(path) != os.path.abspath(pin) and os.path.isfile(path):
            shutil.copy(path, tmp)
    return tmp


def candidate_json(package: str, version: str, log: Log) -> tuple[list[dict], str]:
    """The supported-GPU list inside ``package`` at ``version``: downloaded with apt, unpacked with
    dpkg-deb, never copied by hand. (chips, the file it came from)."""
    work = tempfile.mkdtemp(prefix="verl-lab-gpus-")
    try:
        res = log.run(["apt-get", "download", f"{package}={version}"], check=False, env=APT_ENV, cwd=work)
        debs = sorted(glob.glob(os.path.join(work, "*.deb")))
        if res.returncode != 0 or not debs:
            raise Failed(f"could not download {package} {version} to read its supported-GPU list; nothing was installed")
        log.run(["dpkg-deb", "-x", debs[0], os.path.join(work, "x")])
        found = sorted(glob.glob(os.path.join(work, "x", "**", "supported-gpus.json*"), recursive=True))
        if not found:
            raise Failed(f"{package} {version} carries no supported-gpus.json: the GPUs cannot be checked against "
                         "it; nothing was installed. Install the driver yourself and keep driver = 'check'")
        opener = gzip.open if found[0].endswith(".gz") else open
        with opener(found[0], "rt", encoding="utf-8") as fh:
            chips = apt.supported_chips(fh.read())
        return chips, f"{package} {version}: {found[0].split(os.sep + 'x' + os.sep, 1)[-1]}"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def judge(plan: dict, sim: str, old: dict | None, log: Log, headers_only: bool) -> list[str]:
    """Why the simulated install must not go ahead ([] : it may)."""
    would, gone = apt.simulated(sim), apt.removed(sim)
    if headers_only:
        touched = apt.changed_driver_packages(would, gone)
        return [f"installing the headers alone would change driver packages ({', '.join(touched)})"] if touched else []
    problems = []
    wrong = apt.foreign_branch(would, plan["branch"])
    if wrong:
        problems.append(f"the archive's packages for branch {plan['branch']} would install another branch: "
                        f"{', '.join(wrong)}")
    unasked = apt.unasked_removals(gone, (old or {}).get("packages") or [])
    if unasked:
        problems.append(f"apt would remove NVIDIA packages the stage did not install: {', '.join(unasked)} (a "
                        "Conflicts with the chosen branch's packages); remove them yourself first, or keep "
                        "driver = 'check'")
    fm = plan.get("fabricmanager")
    if fm and fm["package"] in would and would.get(plan["module_package"]) and \
            box_state.upstream(would[fm["package"]]) != box_state.upstream(would[plan["module_package"]]):
        problems.append(f"Fabric Manager {would[fm['package']]} is not the driver's version "
                        f"{would[plan['module_package']]}: Fabric Manager refuses a driver of another version")
    check = plan.get("supported_gpus")
    if check and not problems:
        version = would.get(check["package"]) or installed_version(check["package"])
        if version:
            chips, where = candidate_json(check["package"], version, log)
            bad = apt.unsupported(chips, plan.get("gpus") or [], version, check.get("unlisted"))
            if bad:
                problems.append(f"the candidate driver's own list ({where}) does not support this box's GPUs: "
                                f"{'; '.join(bad)}")
            else:
                log.say(f"ok    every GPU here is in {where}")
    return problems


def installed_version(package: str) -> str | None:
    res = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
    return res.stdout.strip() or None if res.returncode == 0 else None


def restore(old: dict | None, held: list[str], plan: dict, log: Log) -> None:
    """Put back the hold and the pin an install released."""
    if held:
        log.run(["apt-mark", "hold", *held], check=False)
    if old:
        write_pin(plan["pin"], old["text"])
    log.say("restored the previous hold and pin")


def do_install(plan: dict, log: Log, headers_only: bool = False) -> None:
    state = read_box(plan)
    if not headers_only:
        why = busy_problem(plan, state)
        if why:
            raise Failed(why)
    text = _read(plan["pin"])
    old = box_state.parse_pin(text)
    if old:
        old["text"] = text
    log.run(["apt-get", "update"], env=APT_ENV)
    fm = plan.get("fabricmanager")
    wanted = list(plan["headers"]) if headers_only else \
        [*plan["packages"], *([fm["package"]] if fm else []), *plan["headers"]]
    if plan.get("update") and not headers_only:   # every installed package of the branch moves together
        wanted += sorted({p["name"] for p in box_state.installed_from(state, plan["source"])} - set(wanted))
    moves_pin = not headers_only and old is not None and (
        plan.get("update") or box_state.branch_of(old["version"]) != plan["branch"])
    opts = ["-o", f"Dir::Etc::PreferencesParts={prefs_without(plan['pin'])}"] if moves_pin else []
    res = log.run([*APT_INSTALL, *opts, "--allow-change-held-packages", "--simulate", *wanted],
                  check=False, env=APT_ENV)
    kept = "the hold and the pin are as they were" if old else "nothing is held"
    if res.returncode != 0:
        errors = " ".join(line for line in (res.stdout + res.stderr).splitlines() if line.startswith("E:"))
        raise Failed(f"apt cannot install {' '.join(wanted)} from this box's archive ({errors or 'see the log'}); "
                     f"nothing was installed ({kept}). A missing {plan['headers'][0]} means the running kernel is "
                     f"not one of {plan['distro']}'s: boot a kernel of the distro's archive (its headers let DKMS "
                     "build the module)")
    problems = judge(plan, res.stdout, old, log, headers_only)
    if problems:
        raise Failed("; ".join(problems) + f"; nothing was installed ({kept}). Branch {plan['branch']} was chosen "
                     f"for {plan['chosen_for']}")
    would = {**apt.simulated(res.stdout), **apt.removed(res.stdout)}
    held = sorted(p["name"] for p in state.get("packages", ()) if p["held"] and p["name"] in would)
    unpinned = moves_pin and old is not None     # else the pin stays: a package comes back at the pinned version
    if held or unpinned:
        if held:
            log.run(["apt-mark", "unhold", *held])
        if unpinned:
            os.remove(plan["pin"])
        log.say(f"released {'the hold of ' + ' '.join(held) if held else 'no hold'} and "
                f"{'the pin (' + old['version'] + ')' if unpinned else 'not the pin'} for the install the simulation "
                "proved")
    try:
        log.run(["apt-get", "-y", *APT_INSTALL[1:], *opts, *wanted], env=APT_ENV)
    except Failed:
        if held or unpinned:
            restore(old if unpinned else None, held, plan, log)
        raise
    if headers_only:
        return
    do_hold(plan, log)
    if fm:
        log.run(["systemctl", "enable", fm["service"]])
    if subprocess.run(["sh", "-c", "command -v update-initramfs"], capture_output=True).returncode == 0:
        log.run(["update-initramfs", "-u"], check=False)     # the nouveau blacklist, also at early boot


def write_pin(path: str, text: str) -> None:
    part = path + ".part"
    with open(part, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(part, 0o644)
    os.replace(part, path)


def do_hold(plan: dict, log: Log) -> None:
    state = read_box(plan)
    pkgs = box_state.installed_from(state, plan["source"])
    versions = sorted({p["version"] for p in pkgs})
    if len(versions) != 1:
        raise Failed(f"the packages of {plan['source']} installed here are at {', '.join(versions) or 'no version'}: "
                     "expected one version of the branch; nothing was held")
    names = sorted({p["name"] for p in pkgs})
    stanzas = [(names, versions[0])]
    fm = plan.get("fabricmanager")
    if fm:
        fms = [p for p in state.get("packages", ()) if p["name"] == fm["package"] and p["installed"]]
        if not fms:
            raise Failed(f"{fm['package']} is not installed: an NVSwitch box needs Fabric Manager; nothing was held")
        stanzas.append((sorted(p["name"] for p in fms), fms[0]["version"]))
    every = [n for group, _ in stanzas for n in group]
    log.run(["apt-mark", "hold", *every])
    write_pin(plan["pin"], pin_text(stanzas, plan))
    log.say(f"held {len(every)} packages of {plan['source']} at {versions[0]} (apt-mark hold, {plan['pin']})")


def pin_text(stanzas: list[tuple[list[str], str]], plan: dict) -> str:
    names, version = stanzas[0]
    head = (f"# verl-lab driver stage: NVIDIA driver branch {plan['branch']} ({plan['source']} {version}),\n"
            f"# chosen for {plan['chosen_for']}. The packages are also held (apt-mark hold), so neither\n"
            "# unattended-upgrades nor apt upgrade replaces the user-space libraries under the loaded module.\n"
            "# To take a newer build of this branch (security updates): set driver_update = True and re-run the\n"
            "# driver stage on an idle box; it moves this pin once apt proved the new build.\n")
    return head + "\n".join(f"Package: {' '.join(n)}\nPin: version {v}\nPin-Priority: 1001\n" for n, v in stanzas)


def cuda_init() -> int:
    """cuInit(0) through the installed libcuda: 0 when CUDA can use the GPUs."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return -1
    return int(lib.cuInit(0))


def do_prove(plan: dict, log: Log) -> str:
    state = read_box(plan)
    v = box_state.verdict(state, plan["module_package"])
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
    if plan.get("fabricmanager"):
        rc = cuda_init()
        if rc != 0:
            raise Failed(f"cuInit failed ({rc}: {CUDA_ERRORS.get(rc, 'see cuda.h')}): nvidia-smi answers, CUDA does not. "
                         f"See `systemctl status {plan['fabricmanager']['service']}` and "
                         "/var/log/fabricmanager.log")
        log.say("ok    cuInit: CUDA initialises the GPUs through the NVSwitch fabric")
    return installed


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("install", "headers", "hold", "verdict", "load", "prove"))
    parser.add_argument("--plan", required=True, help="driver-plan.json written by the driver stage")
    args = parser.parse_args(argv)
    with open(args.plan, encoding="utf-8") as fh:
        plan = json.load(fh)
    # prove prints only the version on stdout (the marker reads it): its report goes to stderr
    log = Log(plan.get("log") if args.command != "verdict" else None,
              sys.stderr if args.command == "prove" else None)
    try:
        if args.command in ("install", "headers"):
            do_install(plan, log, headers_only=args.command == "headers")
        elif args.command == "hold":
            do_hold(plan, log)
        elif args.command == "verdict":
            print(json.dumps(box_state.verdict(read_box(plan), plan["module_package"])))
        elif args.command == "load":
            log.run(["modprobe", "nvidia"])
            log.run(["modprobe", "nvidia-uvm"], check=False)
            if plan.get("fabricmanager"):
                log.run(["systemctl", "start", plan["fabricmanager"]["service"]])
        else:
            print(do_prove(plan, log))
    except Failed as exc:
        log.say(f"verl-lab driver: {exc}", sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
