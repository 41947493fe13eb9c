"""The hold and the pin of the driver's packages: set once an install is proven (``apt-mark hold``,
dpkg's own selections where apt-mark fails, and the apt preferences pin at the installed version),
and put right after a failure past apt (``secure``): the previous hold and pin where apt changed
nothing, else every driver package dpkg has held and pinned where the transaction was taking it, so
a re-run finishes it. Standard library only.
"""

from __future__ import annotations

import os
import subprocess
import sys

try:
    from verl_lab_box import nvidia_driver_state as box_state
    from verl_lab_box.nvidia_driver_log import Failed, errors
except ImportError:                     # on a box: the modules lie side by side
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import nvidia_driver_state as box_state
    from nvidia_driver_log import Failed, errors

LOCK_WAIT = ("-o", "DPkg::Lock::Timeout=300")      # apt-daily-upgrade may hold dpkg's lock for a while
ABSENT = ("n", "c")                     # dpkg's status: not installed, config files only


def present(state: dict, plan: dict) -> dict[str, list[str]]:
    """The driver's packages dpkg has in any state but absent: {name: [version, status]} (the
    branch's source package and Fabric Manager)."""
    fm = (plan.get("fabricmanager") or {}).get("package")
    return {p["name"]: [p["version"], p.get("status") or ("ii" if p["installed"] else "")]
            for p in state.get("packages", ())
            if (p["source"] == plan["source"] or p["name"] == fm) and (p.get("status") or "ii")[1:2] not in ABSENT}


def theirs(held: list[str], pin: dict | None) -> list[str]:
    """Of ``held`` (the packages held before the stage's hold), those whose hold is not the stage's: not
    named by its pin ``pin`` (the one there before), or named there as held before it (its ``THEIRS``
    line). A hold placed by hand on a package the stage holds already cannot be told apart: it counts as
    the stage's."""
    ours = set((pin or {}).get("packages") or ()) - set((pin or {}).get("theirs") or ())
    return sorted(set(held) - ours)


def unconfigured(status: str) -> bool:
    """dpkg's status (``${db:Status-Abbrev}``) says unpacked, half-configured or half-installed."""
    return status[1:2] in ("U", "F", "H")


def unpack_again(status: str) -> bool:
    """dpkg's status says the package must be unpacked again before it can be configured: its unpack was cut
    (the error flag reinst-required, ``R``: "hUR" where dpkg was killed unpacking it) or it is half-installed
    (``H``). dpkg refuses to configure it ("package is in a very bad inconsistent state"), and apt unpacks it
    again only where told to reinstall it, when it is at the version apt is taking it to."""
    return status[2:3] == "R" or status[1:2] == "H"


def secure(plan: dict, before: dict, log, read) -> str:
    """After a failure past apt (``before``: what the job recorded before releasing anything): apt
    changed no driver package -> the hold and the pin as they were; it did -> every driver package
    dpkg has held, and pinned at the version the transaction was taking it to. Returns what the
    box is left with and what fixes it."""
    state = read()
    now = present(state, plan)
    was = {n: v[0] for n, v in (before.get("versions") or {}).items()}
    changed = sorted(n for n in set(now) | set(was) if was.get(n) != (now.get(n) or [None])[0])
    half = sorted(n for n, (_, status) in now.items() if unconfigured(status))
    if not changed and not half:
        if before.get("held"):
            hold_packages(before["held"], log)
        if before.get("pin"):
            write_pin(plan["pin"], before["pin"])
        return "apt changed no driver package: the previous hold and pin are back"
    if not now:
        return "apt removed the driver's packages: nothing is left to hold"
    hold_packages(sorted(now), log)
    # pinned where the transaction was going (its approved versions), so a re-run finishes it; a
    # package it did not touch stays at the version it has
    target = before.get("target") or {}
    groups: dict[str, list[str]] = {}
    for name, (version, _) in now.items():
        groups.setdefault(target.get(name, version), []).append(name)
    module = target.get(plan["module_package"]) or (now.get(plan["module_package"]) or [None])[0]
    stanzas = sorted(((sorted(n), v) for v, n in groups.items()), key=lambda s: s[1] != module)
    write_pin(plan["pin"], pin_text(stanzas, plan, [n for n in before.get("theirs") or () if n in now]))
    versions = "; ".join(f"{v}: {len(n)} packages" for n, v in stanzas)
    if not half and all(target.get(n, v) == v for n, (v, _) in now.items()):
        return f"apt finished the install: the driver's packages are held and pinned at {versions}"
    said = (f"apt stopped part-way: the driver's packages are held, and pinned at the versions the install was "
            f"taking ({versions})")
    if half:
        said += (f"; dpkg left {', '.join(f'{n} ({now[n][1]})' for n in half)} not configured (a maintainer script "
                 "failed, DKMS's build of the kernel module most often (its make.log under /var/lib/dkms), or apt "
                 "was stopped)")
    loaded = state.get("loaded")
    newest = box_state.upstream(module) if module else None
    if newest and loaded and loaded != newest:
        said += (f"; the loaded kernel module is {loaded} while the user-space libraries are {newest}: new CUDA and "
                 "NVML programs fail ('Driver/library version mismatch') until the module of the installed version "
                 "is built and loaded (a reboot, once DKMS built it)")
    elif newest and not loaded:
        said += f"; no nvidia kernel module is loaded: the module {newest} must be built (DKMS) and loaded"
    again = sorted(n for n, (_, status) in now.items() if unpack_again(status))
    by_hand = (f"`apt-get install --reinstall {' '.join(again)}`, then `dpkg --configure -a`" if again else
               "`dpkg --configure -a`, then `apt-get -f install`")
    return said + (". Fix the cause above, then re-run the driver stage: it finishes the install at those versions "
                   f"and apt configures what dpkg left (by hand: {by_hand})")


def hold_packages(names: list[str], log) -> None:
    """apt-mark hold, waiting for dpkg's lock; where apt-mark fails, dpkg's own selections."""
    res = log.run(["apt-mark", *LOCK_WAIT, "hold", *names], check=False)
    if res.returncode == 0:
        return
    log.say(f"apt-mark hold failed (exit {res.returncode}): holding through `dpkg --set-selections`")
    native = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()
    sel = subprocess.run(["dpkg", "--set-selections"], input=selections(names, native), capture_output=True,
                         text=True)
    log.say(sel.stdout + sel.stderr)
    if sel.returncode != 0:
        raise Failed(f"could not hold {' '.join(names)}: apt-mark hold exited {res.returncode} "
                     f"({errors(res.stdout + res.stderr)}), dpkg --set-selections exited {sel.returncode}; the "
                     "packages are NOT held: unattended-upgrades may replace them. Hold them by hand (`apt-mark hold "
                     f"{' '.join(names)}`)")
    log.say(f"held {len(names)} packages through dpkg --set-selections")


def selections(names: list[str], native: str) -> str:
    """``dpkg --set-selections``' input holding ``names`` (apt's names: ``libcuda1``, ``libcuda1:i386``). A package
    installed for two architectures is named with its architecture, dpkg's own too: a bare ``libcuda1`` is refused
    there ("ambiguous package name 'libcuda1' with more than one installed instance", dpkg 1.21), where apt-mark
    takes it for the native one."""
    twins = {n.split(":", 1)[0] for n in names if ":" in n}
    return "".join(f"{n}:{native} hold\n" if native and n in twins else f"{n} hold\n" for n in names)


def write_pin(path: str, text: str) -> None:
    part = path + ".part"
    with open(part, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(part, 0o644)
    os.replace(part, path)


def do_hold(plan: dict, log, read, kept: list[str] | None = None) -> None:
    """Hold and pin the installed branch. ``kept``: the holds found before the stage's that are not its own
    (``theirs``; the install passes those it read before apt); else read now, before the hold."""
    state = read()
    half = sorted(n for n, (_, status) in present(state, plan).items() if unconfigured(status))
    if half:                            # a hold of the configured part alone would leave these out of the pin
        raise Failed(f"dpkg left {', '.join(half)} not configured: a driver change stopped part-way; re-run the "
                     "driver stage to finish it (nothing was held here)")
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
    if kept is None:
        kept = theirs([p["name"] for p in state.get("packages", ()) if p["held"]], state.get("pin"))
    hold_packages(every, log)
    write_pin(plan["pin"], pin_text(stanzas, plan, [n for n in kept if n in every]))
    log.say(f"held {len(every)} packages of {plan['source']} at {versions[0]} (apt-mark hold, {plan['pin']})")


def pin_text(stanzas: list[tuple[list[str], str]], plan: dict, kept: list[str] | tuple[str, ...] = ()) -> str:
    """``kept``: the packages held before the stage held them (its ``THEIRS`` line, when there are any)."""
    names, version = stanzas[0]
    head = (f"# verl-lab driver stage: NVIDIA driver branch {plan['branch']} ({plan['source']} {version}),\n"
            f"# chosen for {plan['chosen_for']}. The packages are also held (apt-mark hold), so neither\n"
            "# unattended-upgrades nor apt upgrade replaces the user-space libraries under the loaded module.\n"
            "# To take a newer build of this branch (security updates): set driver_update = True and re-run the\n"
            "# driver stage on an idle box; it moves this pin once apt proved the new build.\n")
    if kept:
        head += f"{box_state.THEIRS}{' '.join(sorted(set(kept)))}\n"
    return head + "\n".join(f"Package: {' '.join(n)}\nPin: version {v}\nPin-Priority: 1001\n" for n, v in stanzas)
