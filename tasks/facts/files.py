"""Facts about files verl-lab placed on a box."""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase


class VerifiedArtifact(FactBase[dict | None]):
    """The verified-checksum stamp of an artifact file, if the file is still as stamped.

    Returns ``{"sha256": str, "size": int}`` when ``path`` and ``path.sha256`` exist, the file's
    size matches the stamp and the file was not written to after the stamp was (a copy changed
    in place, same size, is not trusted); else None (the default). Costs a ``stat``, not a re-hash.
    """

    def command(self, path: str) -> str:
        p = shlex.quote(path)
        s = shlex.quote(path + ".sha256")
        return f"if [ -f {p} ] && [ -f {s} ]; then cat {s}; stat -c '%s %.9Y' {p} {s}; else echo none; fi"

    def process(self, output) -> dict | None:
        lines = [line.strip() for line in output if line.strip()]
        if not lines or lines[0] == "none" or len(lines) < 2:
            return self.default()
        parts = lines[0].split()
        size = lines[1].split()
        if len(parts) != 2 or not parts[1].isdigit() or not size or not size[0].isdigit():
            return self.default()
        if int(parts[1]) != int(size[0]):
            return self.default()
        if len(lines) >= 3 and len(size) == 2 and len(lines[2].split()) == 2:
            try:
                if float(size[1]) > float(lines[2].split()[1]):
                    return self.default()  # written to after it was verified
            except ValueError:
                pass                       # a stat without %.9Y: size only
        return {"sha256": parts[0], "size": int(size[0])}


class Marker(FactBase[dict[str, str] | None]):
    """The contents of a stage marker file as a dict of ``key=value`` lines; None (the default)
    without the file, or for an empty one."""

    def command(self, path: str, legacy: str | None = None) -> str:
        """``legacy``: a stage's marker under its old name, read when ``path`` is missing."""
        p = shlex.quote(path)
        if legacy:
            q = shlex.quote(legacy)
            return f"if [ -f {p} ]; then cat {p}; elif [ -f {q} ]; then cat {q}; else echo __none__; fi"
        return f"if [ -f {p} ]; then cat {p}; else echo __none__; fi"

    def process(self, output) -> dict[str, str] | None:
        lines = list(output)
        if not lines or lines[0].strip() == "__none__":
            return self.default()
        found = {}
        for line in lines:
            if "=" in line:
                key, _, value = line.partition("=")
                found[key.strip()] = value.strip()
        return found


class PathStates(FactBase[dict[str, dict | None]]):
    """What is at each path, in one command (pyinfra's own facts cost 1-3 commands per path).

    Returns ``{path: state}`` with state ``None`` (nothing there), ``{"kind": "link"}``,
    ``{"kind": "other"}`` (a socket, a device...), ``{"kind": "dir", "mode", "user", "group"}``
    or ``{"kind": "file", "mode", "user", "group", "sha1"}``; ``mode`` is octal text as
    ``stat %a`` prints it ("755"), an unreadable file's sha1 is ``None``; {} (the default) for
    no paths. A line not in the command's shape is skipped.
    """

    default = dict

    def command(self, paths: list[str]) -> str:
        quoted = " ".join(shlex.quote(p) for p in paths)
        return (f"for p in {quoted}; do "
                "if [ -L \"$p\" ]; then echo \"link - - - - $p\"; "
                "elif [ -d \"$p\" ]; then echo \"dir $(stat -c '%a %U %G' \"$p\") - $p\"; "
                "elif [ -f \"$p\" ]; then echo \"file $(stat -c '%a %U %G' \"$p\") "
                "$(sha1sum < \"$p\" 2>/dev/null | cut -d' ' -f1 | grep . || echo -) $p\"; "
                "elif [ -e \"$p\" ]; then echo \"other - - - - $p\"; "
                "else echo \"none - - - - $p\"; fi; done")

    def process(self, output) -> dict[str, dict | None]:
        found = self.default()
        for line in output:
            parts = line.strip().split(" ", 5)
            if len(parts) != 6:
                continue
            kind, mode, user, group, sha1, path = parts
            if kind == "none":
                found[path] = None
            elif kind in ("link", "other"):
                found[path] = {"kind": kind}
            else:
                state = {"kind": kind, "mode": mode, "user": user, "group": group}
                if kind == "file":
                    state["sha1"] = None if sha1 == "-" else sha1
                found[path] = state
        return found


class PasswdEntry(FactBase[dict | None]):
    """A user's passwd entry as ``{"uid", "gid", "home", "shell"}``, or None (the default)
    without such a user."""

    def command(self, user: str) -> str:
        return f"getent passwd {shlex.quote(user)} || true"

    def process(self, output) -> dict | None:
        for line in output:
            fields = line.strip().split(":")
            if len(fields) == 7:
                return {"uid": int(fields[2]), "gid": int(fields[3]), "home": fields[5], "shell": fields[6]}
        return self.default()


class UnitState(FactBase[dict[str, bool]]):
    """Whether a systemd unit is enabled, active and crash-looping, in one command:
    ``{"enabled", "active", "crash_looping"}``.

    ``enabled`` is True only for ``systemctl is-enabled`` = enabled; ``active`` for
    ``is-active`` = active (or activating: a unit starting now), but not for a unit waiting to be
    restarted after it failed (``activating (auto-restart)``): that one is ``crash_looping``. All
    False (the default) for no such unit, or no systemd (the command handles a missing systemctl:
    no requires_command).
    """

    @staticmethod
    def default() -> dict[str, bool]:
        return {"enabled": False, "active": False, "crash_looping": False}

    def command(self, unit: str) -> str:
        u = shlex.quote(unit)
        return (f"echo \"enabled=$(systemctl is-enabled {u} 2>/dev/null)\"; "
                f"echo \"active=$(systemctl is-active {u} 2>/dev/null)\"; "
                f"echo \"sub=$(systemctl show -p SubState --value {u} 2>/dev/null)\"")

    def process(self, output) -> dict[str, bool]:
        found = {k: v.strip() for k, v in (line.strip().partition("=")[::2] for line in output if "=" in line)}
        looping = found.get("active") == "activating" and found.get("sub") == "auto-restart"
        return {"enabled": found.get("enabled") == "enabled", "crash_looping": looping,
                "active": found.get("active") in ("active", "activating", "reloading") and not looping}


class RootOnlyChain(FactBase[dict[str, dict]]):
    """For each path a root stage works in (``lab_root``, ``install_tmpdir``...): the folders that decide
    who can change it, each as ``{"path", "uid", "mode", "dir"}`` (``mode``: octal text as ``stat %a``
    prints it, with the sticky bit): every existing folder above the path as it resolves now
    (``readlink -m``), and above the folder that holds each part of the path as written (where a link on
    the way lies; whoever can write there can point it elsewhere); and each part of the path as written,
    as ``lstat`` sees it: ``{"path", "kind": "link" | "dir" | "other" | "none", "uid"}`` (``uid`` None
    where it could not be read). Returns ``{path: {"canonical": the path resolved, "parts": [...],
    "written": [...]}}``; {} (the default) for no paths. The parts are read one after the other: a name
    swapped while they are read shows as answers that disagree (``tasks.placed.root_only_problem``)."""

    default = dict

    def command(self, paths: list[str]) -> str:
        quoted = " ".join(shlex.quote(p) for p in paths)
        return ("up() { a=$1; while :; do [ -e \"$a\" ] && echo \"@@part $(stat -c '%u %a' \"$a\") "
                "$([ -d \"$a\" ] && echo d || echo f) $a\"; [ \"$a\" = / ] && break; a=$(dirname \"$a\"); done; }; "
                "lex() { if [ -L \"$1\" ]; then k=link; elif [ -d \"$1\" ]; then k=dir; elif [ -e \"$1\" ]; then k=other; "
                "else echo \"@@written none - $1\"; return; fi; echo \"@@written $k $(stat -c %u \"$1\" 2>/dev/null || "
                "echo -) $1\"; }; "
                f"for p in {quoted}; do {{ echo \"@@path $p\"; echo \"@@canonical $(readlink -m \"$p\")\"; "
                "q=$p; while [ \"$q\" != / ] && [ \"$q\" != . ]; do lex \"$q\"; "
                "up \"$(readlink -m \"$(dirname \"$q\")\")\"; q=$(dirname \"$q\"); done; up \"$(readlink -m \"$p\")\"; "
                "} | awk '!seen[$0]++'; done")

    def process(self, output) -> dict[str, dict]:
        found: dict[str, dict] = self.default()
        current = None
        for line in output:
            line = line.rstrip("\n")
            if line.startswith("@@path "):
                current = found.setdefault(line[len("@@path "):], {"canonical": None, "parts": [], "written": []})
            elif current is None:
                continue
            elif line.startswith("@@canonical "):
                current["canonical"] = line[len("@@canonical "):]
            elif line.startswith("@@written "):
                cells = line[len("@@written "):].split(" ", 2)
                if len(cells) == 3 and cells[0] in ("link", "dir", "other", "none"):
                    current["written"].append({"path": cells[2], "kind": cells[0],
                                               "uid": int(cells[1]) if cells[1].isdigit() else None})
            elif line.startswith("@@part "):
                cells = line[len("@@part "):].split(" ", 3)
                if len(cells) == 4 and cells[0].isdigit() and cells[2] in ("d", "f"):
                    part = {"path": cells[3], "uid": int(cells[0]), "mode": cells[1], "dir": cells[2] == "d"}
                    if part not in current["parts"]:
                        current["parts"].append(part)
        return found


class FolderEntries(FactBase[dict[str, list[str] | None]]):
    """The names in each folder (at most ``limit`` of them, sorted), in one command: ``{path: [name, ...]}``,
    None where the path is no folder (missing, a file, a link: a link is never followed, nor is anything in a
    folder: ``find -P`` lists names only). {} (the default) for no paths. What the undo stage asks before it
    removes a folder it made that a run may have filled (tasks/undo.py): an empty one goes, one with a
    run's files stays."""

    default = dict

    def command(self, paths: list[str], limit: int = 50) -> str:
        quoted = " ".join(shlex.quote(p) for p in paths)
        return (f"for p in {quoted}; do if [ -d \"$p\" ] && [ ! -L \"$p\" ]; then echo \"@@dir $p\"; "
                f"find -P \"$p\" -mindepth 1 -maxdepth 1 -printf '%f\\n' 2>/dev/null | sort | head -n {int(limit)}; "
                "else echo \"@@none $p\"; fi; done")

    def process(self, output) -> dict[str, list[str] | None]:
        found: dict[str, list[str] | None] = self.default()
        current = None
        for line in output:
            line = line.rstrip("\n")
            if line.startswith("@@dir "):
                current = found.setdefault(line[len("@@dir "):], [])
            elif line.startswith("@@none "):
                found[line[len("@@none "):]] = current = None
            elif current is not None and line:
                current.append(line)
        return found
