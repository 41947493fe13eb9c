"""The driver change itself (``nvidia_driver.py install|headers --here``, inside the job's systemd
unit): the units masked and idle, apt's simulation judged, exactly the simulated versions installed,
the hold and the pin set, the initramfs rebuilt, and on every failure after apt the hold and the pin
put back over what apt left. Standard library only.

The order, and what each step guards:

1. the units (training, Ray) idle or, with ``driver_busy = 'stop'``, stopped; masked either way
   (nvidia_driver_units.py), so nothing starts them during the change;
2. ``apt-get update``; ``apt-get install --simulate`` of the packages by name: it must resolve, bring
   only the chosen branch, remove no NVIDIA package the stage did not install, keep Fabric Manager at
   the driver's version; the candidate's own supported-gpus.json must list every GPU (never skipped:
   no list to read stops the install);
3. the approved transaction: every package the simulation installs, named ``pkg=version``, and every
   package asked for that it leaves as it is, named at its installed version. Right before the
   install, the units and the GPUs are checked again and apt simulates that exact command line: a
   list refresh in between (apt-daily) that changes anything stops here, nothing installed;
4. only now the hold (and, for a move of the pin, the pin) is released, and ``restore`` in the job's
   status says what to put back;
5. the install of exactly that command line; the dependencies named only for their version are
   marked automatic again;
6. hold and pin at the installed version, Fabric Manager enabled, ``update-initramfs -u`` (its
   failure stops the stage: the settle step never reboots onto an initramfs it could not build).

Any failure in 5 or 6 (apt, dpkg's maintainer scripts such as DKMS's build, apt-mark, the pin, an
interruption) ends in ``secure``: apt changed no driver package -> the previous hold and pin are
back; it did -> every driver package dpkg has is held, and pinned at the version the transaction was
taking it to (so a re-run finishes it: the packages dpkg left unconfigured are named to apt with the
rest, and one whose unpack was cut, reinst-required, is first unpacked again from the archive's file),
and the message says which packages dpkg left unconfigured and what the loaded module is. Any other
error there (an OSError, a fault of this program) gets the same putting right, and the job's outcome
is a failure that names it.
A job killed outright (SIGKILL, the OOM killer) gets the same from its unit's ExecStopPost. The
hold, the pin and that putting right: nvidia_driver_hold.py.
"""

from __future__ import annotations

import glob
import gzip
import os
import shutil
import subprocess
import sys
import tempfile

try:
    from verl_lab_box import nvidia_driver_apt as apt
    from verl_lab_box import nvidia_driver_job as job
    from verl_lab_box import nvidia_driver_state as box_state
    from verl_lab_box import nvidia_driver_units as units
    from verl_lab_box.nvidia_driver_hold import LOCK_WAIT, do_hold, present, secure, theirs, unconfigured, unpack_again
    from verl_lab_box.nvidia_driver_log import Failed, errors
except ImportError:                     # on a box: the modules lie side by side
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import nvidia_driver_apt as apt
    import nvidia_driver_job as job
    import nvidia_driver_state as box_state
    import nvidia_driver_units as units
    from nvidia_driver_hold import LOCK_WAIT, do_hold, present, secure, theirs, unconfigured, unpack_again
    from nvidia_driver_log import Failed, errors

APT_ENV = {"DEBIAN_FRONTEND": "noninteractive", "NEEDRESTART_MODE": "l", "LC_ALL": "C"}
APT_INSTALL = ("apt-get", "install", "--no-install-recommends",
               "-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold")


def do_install(plan: dict, log, read, headers_only: bool = False) -> None:
    """Install the plan's packages (or the running kernel's headers alone); ``read()`` reads the box
    (nvidia_driver_state's fact). The units stay masked until this returns or raises."""
    if headers_only:                    # the driver, its hold and the loaded module stay as they are
        return _change(plan, log, read, headers_only=True)
    try:
        units.take(plan, read, log)     # refused before masking: nothing to unmask; after: unmasked below
        _change(plan, log, read, headers_only=False)
    finally:
        units.unmask(log)


def _change(plan: dict, log, read, headers_only: bool) -> None:
    state = read()
    text = _read(plan["pin"])
    old = box_state.parse_pin(text)
    log.run(["apt-get", "update"], env=APT_ENV)
    fm = plan.get("fabricmanager")
    wanted = list(plan["headers"]) if headers_only else \
        [*plan["packages"], *([fm["package"]] if fm else []), *plan["headers"]]
    here = present(state, plan)
    if not headers_only and (plan.get("update") or any(unconfigured(s) for _, s in here.values())):
        # every package of the branch dpkg has moves together: an update, or the finish of a change that
        # stopped part-way (a package left behind at the old version, held, would keep apt from resolving)
        wanted += sorted(set(here) - set(wanted))
    moves_pin = not headers_only and old is not None and (
        plan.get("update") or box_state.branch_of(old["version"]) != plan["branch"])
    opts = ["-o", f"Dir::Etc::PreferencesParts={prefs_without(plan['pin'])}"] if moves_pin else []
    # a package whose unpack was cut (dpkg: reinst-required) at the version apt takes it to: apt only asks dpkg to
    # configure it, which dpkg refuses, so the finish would stop there on every re-run; it is unpacked again first
    cut = [] if headers_only else sorted(n for n, (_, status) in here.items() if unpack_again(status))
    kept = "the hold and the pin are as they were" if old else "nothing is held"
    sim = simulate(wanted, opts, log)
    if sim.returncode != 0:
        said = sim.stdout + sim.stderr      # apt: "The package X needs to be reinstalled, but I can't find an archive"
        lost = [n for n in cut if f"package {n} needs to be reinstalled, but I can't find an archive" in said]
        hint = (f"dpkg's unpack of {', '.join(lost)} was cut (reinst-required) at a version this box's archive no "
                "longer has, and apt goes on only with that version's file: put the archive that has it back in "
                "the box's sources, or remove the package as dpkg allows (`dpkg --remove --force-remove-reinstreq "
                f"{' '.join(lost)}`), then re-run the driver stage") if lost else \
            (f"A missing {plan['headers'][0]} means the running kernel is not one of {plan['distro']}'s: boot a "
             "kernel of the distro's archive (its headers let DKMS build the module)")
        raise Failed(f"apt cannot install {' '.join(wanted)} from this box's archive ({errors(sim.stdout + sim.stderr)}); "
                     f"nothing was installed ({kept}). {hint}")
    problems = judge(plan, sim.stdout, old, log, headers_only)
    if problems:
        raise Failed("; ".join(problems) + f"; nothing was installed ({kept}). Branch {plan['branch']} was chosen "
                     f"for {plan['chosen_for']}")
    exact = exact_packages(wanted, sim.stdout)
    log.say(f"ok    apt's simulation approved: {' '.join(exact)}")
    if not headers_only:
        units.check(plan, read, log, "right before apt-get install")
    again = simulate(exact, opts, log)
    if again.returncode != 0 or not apt.same_transaction(sim.stdout, again.stdout):
        gone = ("are gone (" + errors(again.stdout + again.stderr, 240) + ")") if again.returncode else \
            "now bring another transaction"
        raise Failed(f"the archive changed between apt's simulation and the install (a list refresh, such as "
                     f"apt-daily's): the approved versions {gone}; "
                     f"nothing was installed ({kept}). Re-run the driver stage: it simulates and checks what the "
                     "archive has now")
    would = {**apt.simulated(sim.stdout), **apt.removed(sim.stdout)}
    cut = [n for n in cut if n not in would]          # one apt upgrades or reinstalls is unpacked by it
    held = sorted(p["name"] for p in state.get("packages", ()) if p["held"] and (p["name"] in would or p["name"] in cut))
    unpinned = moves_pin and old is not None     # else the pin stays: a package comes back at the pinned version
    # the holds that are not the stage's (a user's own, of the packages it holds): held again after, and so named
    holds = theirs([p["name"] for p in state.get("packages", ()) if p["held"]], old)
    before = {"pin": text, "held": held, "versions": here, "target": apt.simulated(sim.stdout), "theirs": holds}
    if plan.get("job_status"):          # what the job's ExecStopPost puts back if this process is killed
        job.write_status(plan, restore=before)
    auto = set(subprocess.run(["apt-mark", "showauto"], capture_output=True, text=True).stdout.split())
    try:
        if held:
            log.run(["apt-mark", *LOCK_WAIT, "unhold", *held])
        if unpinned:
            os.remove(plan["pin"])
        if held or unpinned:
            log.say(f"released {'the hold of ' + ' '.join(held) if held else 'no hold'} and "
                    f"{'the pin (' + old['version'] + ')' if unpinned else 'not the pin'} for the install the "
                    "simulation proved")
        if cut:
            unpack_archives({n: here[n][0] for n in cut}, log)
        log.run(["apt-get", "-y", *APT_INSTALL[1:], *LOCK_WAIT, *opts, *exact], env=APT_ENV)
        deps = [p.split("=", 1)[0] for p in exact if p.split("=", 1)[0] not in wanted]
        back = sorted(n for n in deps if n in auto or apt.newly_installed(sim.stdout, n))
        if back:                        # named for their version only: apt may remove them with what needs them
            log.run(["apt-mark", "auto", *back], check=False)
        if headers_only:
            return
        do_hold(plan, log, read, holds)
        if fm:
            log.run(["systemctl", "enable", fm["service"]])
        rebuild_initramfs(log)
    except Failed as exc:
        raise Failed(f"{exc}. {secure(plan, before, log, read)}") from None
    except Exception as exc:            # a fault of this program or the box (OSError, a bug): the hold and pin still
        raise Failed(f"the driver change stopped on an unexpected error ({type(exc).__name__}: {exc}). "
                     f"{secure(plan, before, log, read)}") from exc


def unpack_archives(versions: dict[str, str], log) -> None:
    """dpkg unpacks again, from the archive's own files (``apt-get download``: apt checks them against the signed
    lists), the packages whose unpack was cut, at the version dpkg has: plain "unpacked" after it, which the
    install then configures."""
    log.say(f"dpkg must unpack {', '.join(sorted(versions))} again (its unpack was cut: dpkg refuses to configure "
            "it): unpacking the archive's file of the same version")
    folder = tempfile.mkdtemp(prefix="verl-lab-debs-")
    try:
        log.run(["apt-get", "download", *[f"{n}={v}" for n, v in sorted(versions.items())]], cwd=folder, env=APT_ENV)
        log.run(["dpkg", "--unpack", *sorted(glob.glob(os.path.join(folder, "*.deb")))], env=APT_ENV)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def simulate(packages: list[str], opts: list[str], log):
    return log.run([*APT_INSTALL, *opts, "--allow-change-held-packages", "--simulate", *packages],
                   check=False, env=APT_ENV)


def exact_packages(wanted: list[str], sim: str) -> list[str]:
    """The command line that installs exactly what ``sim`` approved: every package it installs as
    ``pkg=version``, and every package asked for that it leaves alone at its installed version (by
    name, apt would upgrade it to whatever a later list refresh made the candidate)."""
    would = apt.simulated(sim)
    exact = [f"{name}={version}" for name, version in sorted(would.items())]
    for name in wanted:
        if name in would:
            continue
        version = installed_version(name)
        if not version:
            raise Failed(f"apt's simulation gave no version for {name} and it is not installed: the install cannot "
                         "be pinned to what was checked; nothing was installed")
        exact.append(f"{name}={version}")
    return exact


def prefs_without(pin: str) -> str:
    """A copy of /etc/apt/preferences.d without the stage's own pin (for a simulation that may move
    the pinned version: an update on purpose, or another branch)."""
    tmp = tempfile.mkdtemp(prefix="verl-lab-prefs-")
    here = os.path.dirname(pin)
    for path in glob.glob(os.path.join(here, "*")):
        if os.path.abspath(path) != os.path.abspath(pin) and os.path.isfile(path):
            shutil.copy(path, tmp)
    return tmp


def candidate_json(package: str, version: str, log) -> tuple[list[dict], str]:
    """The supported-GPU list inside ``package`` at ``version``: downloaded with apt, unpacked with
    dpkg-deb, never copied by hand. (chips, the file it came from)."""
    work = tempfile.mkdtemp(prefix="verl-lab-gpus-")
    try:
        res = log.run(["apt-get", "download", f"{package}={version}"], check=False, env=APT_ENV, cwd=work)
        debs = sorted(glob.glob(os.path.join(work, "*.deb")))
        if res.returncode != 0 or not debs:
            raise Failed(f"could not download {package} {version}, the version apt's simulation chose, to read its "
                         f"supported-GPU list ({errors(res.stdout + res.stderr)}); nothing was installed. If the archive "
                         "changed since the simulation (a list refresh), re-run the driver stage")
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


def judge(plan: dict, sim: str, old: dict | None, log, headers_only: bool) -> list[str]:
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
    return problems or supported_gpus_problems(plan, would, log)


def supported_gpus_problems(plan: dict, would: dict[str, str], log) -> list[str]:
    """The GPUs the candidate's own supported-gpus.json does not support. Never skipped: a plan that
    names no list, no GPU to check, or a list package neither simulated nor installed stops the
    install with that reason."""
    check = plan.get("supported_gpus")
    if not check:
        return ["the plan names no package whose supported-gpus.json lists the GPUs: the GPUs cannot be checked "
                "against the driver that would be installed (files/drivers.toml: supported_gpus)"]
    gpus = plan.get("gpus") or []
    if not gpus:
        return ["no GPU was read on this box (PCI bus and nvidia-smi): there is nothing to check against "
                f"{check['package']}'s supported-gpus.json; set gpu_override, or keep driver = 'check'"]
    version = would.get(check["package"]) or installed_version(check["package"])
    if not version:
        return [f"{check['package']}, whose supported-gpus.json lists the GPUs, is neither in apt's simulation nor "
                "installed: the GPUs cannot be checked against the driver that would be installed"]
    chips, where = candidate_json(check["package"], version, log)
    bad = apt.unsupported(chips, gpus, version, check.get("unlisted"))
    if bad:
        return [f"the candidate driver's own list ({where}) does not support this box's GPUs: {'; '.join(bad)}"]
    log.say(f"ok    every GPU here is in {where}")
    return []


def installed_version(package: str) -> str | None:
    res = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
    return res.stdout.strip() or None if res.returncode == 0 else None


def rebuild_initramfs(log) -> None:
    """update-initramfs -u (the nouveau blacklist at early boot, the new module's files): a failure
    stops the stage, so the settle step never reboots onto it."""
    if subprocess.run(["sh", "-c", "command -v update-initramfs"], capture_output=True).returncode != 0:
        log.say("no update-initramfs on this box (no initramfs-tools): no initramfs to rebuild")
        return
    res = log.run(["update-initramfs", "-u"], check=False)
    if res.returncode != 0:
        raise Failed(f"update-initramfs -u failed (exit {res.returncode}: {errors(res.stdout + res.stderr)}): the "
                     "initramfs the next boot loads may still bind nouveau or an old nvidia module, so the stage "
                     "does not reboot onto it. Make `update-initramfs -u` succeed (a full /boot is the usual cause: "
                     "`df -h /boot`), then re-run the driver stage")


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return ""
