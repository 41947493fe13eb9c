"""Facts for the model and dataset stage: what a box holds of a Hugging Face snapshot."""

from __future__ import annotations

import json
import shlex

from pyinfra.api import FactBase


class SnapshotStamp(FactBase[dict | None]):
    """The verified stamp (``<dest>.verified.json``) of a snapshot folder, as a dict; None (the
    default) without the folder or the stamp, or for a stamp that is not a JSON object.

    Written by ``verl_lab_box/hf_snapshot.py`` only after every file of the folder was checked; a
    ``digest`` equal to the spec's means the folder is that snapshot. Costs a ``cat``.
    """

    def command(self, dest: str) -> str:
        s = shlex.quote(dest + ".verified.json")
        d = shlex.quote(dest)
        return f"if [ -d {d} ] && [ -f {s} ]; then cat {s}; else echo __none__; fi"

    def process(self, output) -> dict | None:
        text = "\n".join(output).strip()
        if not text or text == "__none__":
            return self.default()
        try:
            stamp = json.loads(text)
        except ValueError:
            return self.default()
        return stamp if isinstance(stamp, dict) else self.default()


class StagedFiles(FactBase[dict[str, str]]):
    """sha256 of every file under a staging folder: ``{relative path: sha256}`` ({}, the
    default, without the folder or files; lines that are not ``<sha256>  <path>`` are skipped).

    Read only when a snapshot is not installed yet, so a relay push cut short resumes by
    uploading just the files that are missing or differ.
    """

    default = dict

    def command(self, path: str) -> str:
        p = shlex.quote(path)
        return (f"if [ -d {p} ]; then cd {p} && find . -type f ! -path './.cache/*' ! -path './.parts/*' "
                f"-exec sha256sum {{}} +; fi; true")

    def process(self, output) -> dict[str, str]:
        found = self.default()
        for line in output:
            parts = line.strip().split(None, 1)
            if len(parts) == 2 and len(parts[0]) == 64:
                found[parts[1].removeprefix("./").lstrip("*")] = parts[0]
        return found


class FilesPresent(FactBase[dict[str, int | None]]):
    """Sizes of the given paths: ``{path: size in bytes, or None when not a file}`` ({}, the
    default, for no paths)."""

    default = dict

    def command(self, paths: tuple[str, ...] | list[str]) -> str:
        checks = [f"if [ -f {shlex.quote(p)} ]; then echo \"$(stat -c %s {shlex.quote(p)}) {p}\"; "
                  f"else echo \"- {p}\"; fi" for p in paths]
        return "; ".join(checks) or "true"

    def process(self, output) -> dict[str, int | None]:
        found = self.default()
        for line in output:
            size, _, path = line.strip().partition(" ")
            found[path] = int(size) if size.isdigit() else None
        return found


class PythonModules(FactBase[dict[str, bool] | None]):
    """Which of ``modules`` the interpreter at ``python`` can import: ``{module: bool}``,
    or None (the default) when there is no such interpreter."""

    def command(self, python: str, modules: tuple[str, ...] | list[str]) -> str:
        py = shlex.quote(python)
        code = shlex.quote("import importlib.util as u, sys\n"
                           "for m in sys.argv[1:]: print(m, int(u.find_spec(m) is not None))")
        mods = " ".join(shlex.quote(m) for m in modules)
        return f"if [ -x {py} ]; then {py} -c {code} {mods}; else echo __nopython__; fi"

    def process(self, output) -> dict[str, bool] | None:
        lines = [line.strip() for line in output if line.strip()]
        if not lines or lines[0] == "__nopython__":
            return self.default()
        found = {}
        for line in lines:
            name, _, flag = line.partition(" ")
            found[name] = flag == "1"
        return found
