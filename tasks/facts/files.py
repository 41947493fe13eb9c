"""Facts about files verl-lab placed on a box."""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase


class VerifiedArtifact(FactBase):
    """The verified-checksum stamp of an artifact file, if the file is still as stamped.

    Returns ``{"sha256": str, "size": int}`` when ``path`` and ``path.sha256`` exist, the file's
    size matches the stamp and the file was not written to after the stamp was (a copy changed
    in place, same size, is not trusted); else ``None``. Costs a ``stat``, not a re-hash.
    """

    def command(self, path: str) -> str:
        p = shlex.quote(path)
        s = shlex.quote(path + ".sha256")
        return f"if [ -f {p} ] && [ -f {s} ]; then cat {s}; stat -c '%s %.9Y' {p} {s}; else echo none; fi"

    def process(self, output):
        lines = [line.strip() for line in output if line.strip()]
        if not lines or lines[0] == "none" or len(lines) < 2:
            return None
        parts = lines[0].split()
        size = lines[1].split()
        if len(parts) != 2 or not parts[1].isdigit() or not size or not size[0].isdigit():
            return None
        if int(parts[1]) != int(size[0]):
            return None
        if len(lines) >= 3 and len(size) == 2 and len(lines[2].split()) == 2:
            try:
                if float(size[1]) > float(lines[2].split()[1]):
                    return None          # written to after it was verified
            except ValueError:
                pass                     # a stat without %.9Y: size only
        return {"sha256": parts[0], "size": int(size[0])}


class Marker(FactBase):
    """The contents of a stage marker file as a dict of ``key=value`` lines, or None."""

    def command(self, path: str) -> str:
        p = shlex.quote(path)
        return f"if [ -f {p} ]; then cat {p}; else echo __none__; fi"

    def process(self, output):
        lines = list(output)
        if lines and lines[0].strip() == "__none__":
            return None
        found = {}
        for line in lines:
            if "=" in line:
                key, _, value = line.partition("=")
                found[key.strip()] = value.strip()
        return found


class PathModes(FactBase):
    """Mode, owner and group of each path: ``{path: ("755", "root", "root") | None}``.

    One command for many paths (pyinfra's own Directory fact costs one per path).
    """

    def command(self, paths: list[str]) -> str:
        quoted = " ".join(shlex.quote(p) for p in paths)
        return (f"for p in {quoted}; do if [ -d \"$p\" ] && [ ! -L \"$p\" ]; then "
                "echo \"$(stat -c '%a %U %G' \"$p\") $p\"; else echo \"- - - $p\"; fi; done")

    def process(self, output):
        found = {}
        for line in output:
            parts = line.strip().split(" ", 3)
            if len(parts) == 4:
                mode, user, group, path = parts
                found[path] = None if mode == "-" else (mode, user, group)
        return found


class PasswdEntry(FactBase):
    """A user's passwd entry as ``{"uid", "gid", "home", "shell"}``, or None."""

    def command(self, user: str) -> str:
        return f"getent passwd {shlex.quote(user)} || true"

    def process(self, output):
        for line in output:
            fields = line.strip().split(":")
            if len(fields) == 7:
                return {"uid": int(fields[2]), "gid": int(fields[3]), "home": fields[5], "shell": fields[6]}
        return None
