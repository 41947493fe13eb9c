"""A box's state as a listing, to tell whether a deploy left it as one that never had a setting.

``box_listing`` reads, in one ssh command: every file, folder and link under ``/opt`` (which holds the lab root
``/opt/verl-lab``), ``/usr/local`` and ``/etc/systemd/system`` (its type, mode, owner and group; a file's sha256, a
link's target), ``/etc/hosts``' bytes, the users (``/etc/passwd``: name, uid, home, shell), every unit of the
lab (``verl-lab-*``, loaded or only on disk: enabled and active) and the packages on hold (``apt-mark showhold``: a
hold outlives the setting that set it, the driver stage's, unless it is released). ``listing_diff`` names what
differs between two listings, one line a path. Paths under ``skip`` (``skipped``) are left out, for a folder whose
files differ for reasons the test names (e.g. a copy whose file names hold the time it was made).
"""

from __future__ import annotations

import shlex

ROOTS = ("/opt", "/usr/local", "/etc/systemd/system")

_SCRIPT = r"""
for r in {roots}; do
  [ -e "$r" ] && find -P "$r" \( -type f -printf 'f %p\t%m %u %g\n' \) -o \( -type l -printf 'l %p\t%l\n' \) \
    -o \( -printf '%y %p\t%m %u %g\n' \)
done | sort
echo '@@sha'
for r in {roots}; do [ -e "$r" ] && find -P "$r" -type f -print0; done | sort -z | xargs -0 -r sha256sum
echo '@@hosts'
sha256sum /etc/hosts
echo '@@users'
awk -F: '{{ print $1, $3, $6, $7 }}' /etc/passwd | sort
echo '@@units'
# a unit whose file is gone and that runs nothing (not-found, inactive) is systemd's memory of it until its next
# garbage collection, which a loaded machine delays: not a state of the box
systemctl list-units --all --plain --no-legend 'verl-lab*' | \
  awk '$2 != "not-found" || $3 != "inactive" {{ print "loaded", $1, $2, $3, $4 }}'
for u in $(systemctl list-unit-files --no-legend 'verl-lab*' | awk '{{ print $1 }}'); do
  echo "file $u $(systemctl is-enabled "$u" 2>/dev/null) $(systemctl is-active "$u" 2>/dev/null)"
done | sort
echo '@@holds'
apt-mark showhold | sort
"""


def skipped(path: str, prefix: str) -> bool:
    """``prefix`` ending in ``/``: what is inside that folder (the folder itself is listed); else the path and
    what is inside it."""
    return path.startswith(prefix) if prefix.endswith("/") else path == prefix or path.startswith(prefix + "/")


def box_listing(box, roots=ROOTS, skip=()) -> dict[str, dict]:
    """``{"paths": {path: "f 644 root root <sha256>" | "d 755 root root" | "l -> target"}, "hosts": sha256,
    "users": [...], "units": [...], "holds": [package]}`` of ``box`` (tests/lab/box.py) now."""
    script = _SCRIPT.format(roots=" ".join(shlex.quote(r) for r in roots))
    out = box.ssh(script, timeout=300).stdout
    section, paths, shas, rest = "paths", {}, {}, {"hosts": [], "users": [], "units": [], "holds": []}
    for line in out.splitlines():
        if line.startswith("@@"):
            section = line[2:]
            continue
        if section == "paths" and "\t" in line:
            kind_path, _, meta = line.partition("\t")
            kind, _, path = kind_path.partition(" ")
            paths[path] = f"{kind} -> {meta}" if kind == "l" else f"{kind} {meta}"
        elif section == "sha" and line.strip():
            digest, _, path = line.partition("  ")
            shas[path] = digest
        elif section in rest and line.strip():
            rest[section].append(line.split()[0] if section == "hosts" else line)
    for path, digest in shas.items():
        if path in paths:
            paths[path] += f" {digest}"
    paths = {p: v for p, v in paths.items() if not any(skipped(p, s) for s in skip)}
    return {"paths": paths, "hosts": "".join(rest["hosts"]), "users": rest["users"], "units": rest["units"],
            "holds": rest["holds"]}


def listing_diff(before: dict, after: dict) -> list[str]:
    """What differs, one line each: ``+ path`` (only after), ``- path`` (only before), ``~ path: a != b``; the
    same for /etc/hosts, the users, the units and the holds. [] where the listings are the same."""
    out = []
    a, b = before["paths"], after["paths"]
    for path in sorted(set(a) | set(b)):
        if path not in a:
            out.append(f"+ {path} ({b[path]})")
        elif path not in b:
            out.append(f"- {path} ({a[path]})")
        elif a[path] != b[path]:
            out.append(f"~ {path}: {a[path]} != {b[path]}")
    if before["hosts"] != after["hosts"]:
        out.append("~ /etc/hosts: its bytes differ")
    for key in ("users", "units", "holds"):
        gone, new = sorted(set(before[key]) - set(after[key])), sorted(set(after[key]) - set(before[key]))
        out += [f"- {key}: {line}" for line in gone] + [f"+ {key}: {line}" for line in new]
    return out
