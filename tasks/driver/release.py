"""``driver = "check"`` on a box the driver stage managed (pure): its hold and pin released, its own files removed,
the driver kept (docs/driver.md, "Back to check").

A user who sets ``driver`` back to ``"check"`` wants the stage to stop managing the driver, not to lose a working
driver. So, from what the stage left (``tasks.facts.driver.DriverLeft`` and the paths' states):

- released: ``apt-mark unhold`` of exactly the packages the pin's ``Package:`` lines name, but those its ``THEIRS``
  line says were held before the stage held them (a hold of the user's own stays, and the kept line names it), the
  pin ``/etc/apt/preferences.d/verl-lab-nvidia-driver``, ``<lab_root>/libexec/driver`` (the box program,
  ``driver-plan.json``, the job's status) and ``markers/driver.done``; the stage's runtime masks of the
  training, Ray and burn-in units (``/run/systemd/system.control``) where no driver change runs;
- kept, and said so: the installed driver; the nouveau blacklist while NVIDIA driver packages remain (the driver
  needs it at every boot); ``/etc/apt/sources.list.d/verl-lab-nvidia.sources`` while they remain (their updates come
  from those components); the stage's log ``<lab_root>/logs/driver.log`` (the record of what it did to the box's
  packages, which the doctor reads). From then on apt and unattended-upgrades may update the driver like any
  package, as on a box whose driver was installed by hand;
- once no NVIDIA driver package remains (purged by hand) and no other NVIDIA driver is there (NVIDIA's .run
  installer's uninstaller, or a loaded nvidia module: a driver that also needs nouveau kept away), the blacklist and
  the sources file go too (the initramfs rebuilt without the blacklist);
- never while a driver change runs or stopped part-way (its job unit active, dpkg interrupted or leaving a driver
  package unconfigured, a pinned package at a version other than its pin's): released then, apt would be free to
  replace half-installed packages with whatever the archive has. The box is refused, nothing changed, with what
  was found and the doctor's cause and fix for it (files/doctor/driver.toml; the words match its rule).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tasks.driver.plan import BLACKLIST_FILE, PIN_FILE, SOURCES_FILE, DriverWant
from verl_lab_box.nvidia_driver_hold import LOCK_WAIT, unconfigured
from verl_lab_box.nvidia_driver_state import JOB_UNIT, MASK_DIR, PROC_VERSION, RUNFILE_UNINSTALLER
from verl_lab_box.nvidia_driver_units import IDLE, RECORD

DRIVER_SOURCES = "nvidia-graphics-drivers"      # Debian's source package; Ubuntu's: nvidia-graphics-drivers-580-server
WHY = "driver = 'check': the driver stage no longer manages the driver"
# a driver that no package brought, which needs nouveau kept away as much: NVIDIA's .run installer's uninstaller, or
# any nvidia module loaded now (the .run's, NVIDIA's own repository's open modules, a driver purged but still loaded)
OTHER_DRIVER = (RUNFILE_UNINSTALLER, PROC_VERSION)


@dataclass(frozen=True)
class Step:
    name: str                       # the operation's name: what is undone and why
    commands: tuple[str, ...]


@dataclass(frozen=True)
class Release:
    steps: tuple[Step, ...] = ()
    kept: str = ""                  # the line of what stays, printed where the hold is released
    refusal: str = ""               # why nothing is released now ("" : nothing refused)


def stage_paths(want: DriverWant) -> list[str]:
    """The paths whose state ``plan_release`` reads (PathStates): the stage's, and the signs of a driver no package
    brought (``OTHER_DRIVER``)."""
    return [PIN_FILE, want.libexec, want.marker, BLACKLIST_FILE, SOURCES_FILE, want.log, *OTHER_DRIVER]


def pinned(left: Mapping) -> dict[str, str]:
    """The pin's packages and each one's pinned version (a second stanza: Fabric Manager's own)."""
    return {name: s["version"] for s in ((left.get("pin") or {}).get("stanzas") or ()) for name in s["packages"]}


def driver_packages(left: Mapping) -> list[dict]:
    """The packages dpkg knows (in any state) that are the stage's: named by its pin, or built from the driver's
    source package."""
    names = pinned(left)
    return [p for p in left.get("packages") or () if p["name"] in names or p["source"].startswith(DRIVER_SOURCES)]


def unfinished(left: Mapping) -> tuple[str, str] | None:
    """A driver change running or stopped part-way: (what was found, the doctor's rule for it or ""); None."""
    job = left.get("job") or "inactive"
    if job not in IDLE:
        return f"a driver change is still running here ({JOB_UNIT}): it is {job}", "driver-change-running"
    if left.get("dpkg_updates"):
        return (f"dpkg was interrupted (/var/lib/dpkg/updates holds {len(left['dpkg_updates'])} files; apt says \"E: "
                "dpkg was interrupted, you must manually run 'dpkg --configure -a' to correct the problem\")",
                "driver-dpkg-interrupted")
    ours = driver_packages(left)
    half = [f"{p['name']} ({p['status']})" for p in ours if unconfigured(p.get("status") or "ii")]
    if half:
        return f"dpkg left {', '.join(half)} not configured", "driver-dpkg-half-configured"
    pins = pinned(left)
    off = [f"{p['name']} {p['version']}" for p in ours if p["installed"] and p["name"] in pins
           and p["version"] != pins[p["name"]]]
    if off:
        return (f"a driver change did not finish: the pin holds {len(pins)} packages at "
                f"{', '.join(sorted(set(pins.values())))}, and dpkg has {', '.join(off)}"), ""
    return None


def refusal_text(host: str, found: tuple[str, str], rules: Mapping) -> str:
    what, rule_id = found
    rule = rules.get(rule_id)
    doctor = f" The doctor ({rule_id}): {rule.cause} Fix: {rule.fix}" if rule else ""
    then = ("" if rule_id == "driver-change-running" else
            " The driver stage finishes a change only with driver = 'install': run it once for this box "
            f"(`pyinfra -y <inventory> deploy/driver.py --limit {host} --data driver=install`), then set "
            "driver = 'check' again.")
    return (f"verl-lab driver: {host}: driver = 'check' releases the driver stage's hold and pin, but not now "
            f"(nothing was changed): {what}. Released under an unfinished change, apt would be free to replace the "
            f"half-installed packages with whatever the archive has.{doctor}{then}")


def _quoted(paths) -> str:
    return " ".join(shlex.quote(p) for p in paths)


def unmask_step(units: list[str]) -> Step:
    """Remove the stage's own masks (links to /dev/null only), reload systemd, drop the stage's record."""
    links = [f"{MASK_DIR}/{u}" for u in units]
    return Step(f"NVIDIA driver: unmask {' '.join(units)} (masked by a driver change that did not end, and none "
                f"runs; {WHY})",
                (*(f"[ \"$(readlink {shlex.quote(link)})\" != /dev/null ] || rm -f {shlex.quote(link)}"
                   for link in links), "systemctl daemon-reload", f"rm -f {RECORD}"))


def released(left: Mapping) -> list[str]:
    """The packages whose hold is the stage's: held, named by its pin, not held before it held them (the pin's
    ``THEIRS`` line)."""
    names, theirs = pinned(left), set((left.get("pin") or {}).get("theirs") or ())
    return sorted({p["name"] for p in left.get("packages") or () if p["held"] and p["name"] in names
                   and p["name"] not in theirs})


def release_step(want: DriverWant, left: Mapping, there: list[str]) -> Step:
    """The hold of the pin's packages released and the stage's own files removed, then checked."""
    held = released(left)
    libexec = want.libexec.rsplit("/", 1)[0]
    commands = [f"apt-mark {' '.join(LOCK_WAIT)} unhold {_quoted(held)} >/dev/null"] if held else []
    commands += [f"rm -rf {_quoted(there)}",
                 f"[ ! -d {shlex.quote(libexec)} ] || rmdir --ignore-fail-on-non-empty {shlex.quote(libexec)}"]
    if held:
        commands.append(f"if apt-mark showhold | grep -qxF {' '.join('-e ' + shlex.quote(n) for n in held)}; then "
                        "echo 'verl-lab driver: the driver packages are still held after apt-mark unhold' >&2; "
                        "exit 1; fi")
    undone = ([f"apt-mark unhold of its {len(held)} packages"] if held else []) + [f"{p} removed" for p in there]
    return Step(f"NVIDIA driver: hold and pin released ({WHY}): {', '.join(undone)}", tuple(commands))


def kept_line(want: DriverWant, remain: list[dict], paths: Mapping, unheld: Sequence[str] = ()) -> str:
    """What stays where the hold is released and driver packages remain, and why; the driver's packages that stay
    held (``unheld``: those the release unholds) named, so the line claims no update apt will not make."""
    if not remain:
        signs = [p for p in OTHER_DRIVER if paths.get(p) is not None]
        files = [p for p in (BLACKLIST_FILE, SOURCES_FILE) if paths.get(p) is not None]
        return (f"kept {' and '.join(files)}: no NVIDIA driver package is installed, but a driver no package brought "
                f"is here ({' and '.join(f'{p} exists' for p in signs)}), and it needs nouveau kept away as much; "
                f"remove {'them' if len(files) > 1 else 'it'} by hand (then `update-initramfs -u`) once that driver "
                "is gone" if signs and files else "")
    still = sorted({p["name"] for p in remain if p["held"] and p["name"] not in unheld})
    versions = sorted({p["version"] for p in remain})
    files = [f"the nouveau blacklist {BLACKLIST_FILE}"] if paths.get(BLACKLIST_FILE) is not None else []
    if paths.get(SOURCES_FILE) is not None:
        files.append(f"{SOURCES_FILE} (the apt components its packages update from)")
    if paths.get(want.log) is not None:
        files.append(f"the stage's log {want.log}")
    held = (f"; {len(still)} of its packages {'stays' if len(still) == 1 else 'stay'} held, by holds that are not "
            f"the stage's (placed before it held them, or with its pin gone the stage cannot tell): {' '.join(still)}; "
            f"apt updates the driver only once those are released too (`apt-mark unhold {' '.join(still)}`)"
            if still else "")
    return (f"kept the installed NVIDIA driver ({len(remain)} packages at {', '.join(versions)})"
            f"{', ' + ', '.join(files) if files else ''}: {WHY}, and a working driver "
            f"stays{held}. apt and unattended-upgrades may now update {'the rest' if still else 'it'} like any package "
            "(the new module loads at the next reboot); set driver = 'install' to hold it again, or purge it by hand")


def leftovers_step(there: list[str]) -> Step:
    """No NVIDIA driver package remains: the blacklist and the sources file go, the initramfs rebuilt."""
    commands = [f"rm -f {_quoted(there)}"]
    if BLACKLIST_FILE in there:
        commands.append("if command -v update-initramfs >/dev/null; then update-initramfs -u; fi")
    return Step(f"NVIDIA driver: {' and '.join(there)} removed ({WHY}, and no NVIDIA driver package is installed"
                f"{'; the initramfs rebuilt without the blacklist' if BLACKLIST_FILE in there else ''})",
                tuple(commands))


def plan_release(host: str, want: DriverWant, left: Mapping, paths: Mapping, rules: Mapping | None = None) -> Release:
    """What ``driver = "check"`` undoes on this box of what the driver stage left, or why not now."""
    there = [p for p in (PIN_FILE, want.libexec, want.marker) if paths.get(p) is not None]
    masked = [u for u in left.get("masks") or () if u in (left.get("recorded") or ())]
    remain = [p for p in driver_packages(left) if p["installed"]]
    other = any(paths.get(p) is not None for p in OTHER_DRIVER)
    files = [] if remain or other else [p for p in (BLACKLIST_FILE, SOURCES_FILE) if paths.get(p) is not None]
    if not (there or masked or files):
        return Release()
    found = unfinished(left) if there or masked else None
    if found:
        if rules is None:
            from tasks.doctor import RULES_DIR, load_rules
            rules = {r.id: r for r in load_rules(RULES_DIR / "driver.toml")}
        return Release(refusal=refusal_text(host, found, rules))
    steps = ([unmask_step(masked)] if masked else []) + ([release_step(want, left, there)] if there else []) \
        + ([leftovers_step(files)] if files else [])
    return Release(tuple(steps), kept_line(want, remain, paths, released(left)) if there else "")
