"""Facts about a box's CUDA toolkits and where /usr/local/cuda points (the driver and the GPUs are
one fact of their own: tasks.facts.gpu.NvidiaGpus, read once per host, ``driver_view``).

The parsers are plain functions of the command output (unit-tested against real output
formats); the fact classes only say what to run and hand the lines to them.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

from pyinfra.api import FactBase

CUDA_LINK = "/usr/local/cuda"
# Left inside a toolkit prefix while verl-lab installs into it; removed after the proofs pass.
IN_PROGRESS = ".verl-lab-in-progress"

_NVCC_RE = re.compile(r"release\s+(\d+\.\d+),\s+V(\d+\.\d+\.\d+)")
_CUDNN_RE = re.compile(r"^\s*#\s*define\s+CUDNN_(MAJOR|MINOR|PATCHLEVEL)\s+(\d+)\s*$")


def parse_nvcc_version(text: str) -> dict | None:
    """``nvcc --version`` -> ``{"release": "11.8", "version": "11.8.89"}``, or None."""
    match = _NVCC_RE.search(text or "")
    if not match:
        return None
    return {"release": match.group(1), "version": match.group(2)}


def parse_cudnn_version_header(text: str) -> str | None:
    """``#define CUDNN_MAJOR 8`` / ``MINOR 9`` / ``PATCHLEVEL 7`` -> ``"8.9.7"``, or None."""
    found = {}
    for line in (text or "").splitlines():
        match = _CUDNN_RE.match(line)
        if match:
            found.setdefault(match.group(1), match.group(2))
    if {"MAJOR", "MINOR", "PATCHLEVEL"} <= found.keys():
        return f"{found['MAJOR']}.{found['MINOR']}.{found['PATCHLEVEL']}"
    return None


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _sections(lines: Iterable[str]) -> list[tuple[str, list[str]]]:
    """Split fact output on ``@@ <name>`` header lines."""
    out: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("@@ "):
            out.append((line[3:].strip(), []))
        elif out:
            out[-1][1].append(line)
    return out


class CudaToolkits(FactBase[dict]):
    """CUDA toolkits under ``/usr/local/cuda-*`` (and the given prefixes), and ``/usr/local/cuda``.

    Returns::

        {"link": "/usr/local/cuda-12.4" (readlink target) | None (absent) | "<not a link>",
         "toolkits": {"/usr/local/cuda-11.8": {"nvcc": {"release": "11.8", "version": "11.8.89"} or None,
                                                "cudnn": "8.9.7" or None,
                                                "in_progress": bool}}}

    A prefix appears only when it exists as a directory; the default, nothing there:
    ``{"link": None, "toolkits": {}}``.
    """

    @staticmethod
    def default() -> dict:
        return {"link": None, "toolkits": {}}

    def command(self, prefixes: Iterable[str] = ()) -> str:
        extra = " ".join(shlex.quote(p) for p in prefixes)
        link = shlex.quote(CUDA_LINK)
        return (
            f"echo '@@ link'; if [ -L {link} ]; then readlink {link}; "
            f"elif [ -e {link} ]; then echo '<not a link>'; fi; "
            f"for d in /usr/local/cuda-* {extra}; do "
            '[ -d "$d" ] || continue; '
            'echo "@@ toolkit $d"; '
            'if [ -x "$d/bin/nvcc" ]; then timeout 20 "$d/bin/nvcc" --version 2>&1; fi; '
            'echo "@@ cudnn $d"; '
            'if [ -f "$d/include/cudnn_version.h" ]; then grep -E "define CUDNN_(MAJOR|MINOR|PATCHLEVEL)" "$d/include/cudnn_version.h"; fi; '
            f'if [ -e "$d/{IN_PROGRESS}" ]; then echo "@@ in-progress $d"; fi; '
            "done; true"
        )

    def process(self, output) -> dict:
        return toolkits_from_sections(_sections(output))


def toolkits_from_sections(sections: list[tuple[str, list[str]]]) -> dict:
    link = None
    toolkits: dict[str, dict] = {}
    for name, lines in sections:
        kind, _, path = name.partition(" ")
        text = "\n".join(lines)
        if kind == "link":
            stripped = [line.strip() for line in lines if line.strip()]
            link = stripped[0] if stripped else None
        elif kind == "toolkit":
            toolkits.setdefault(path, {"nvcc": None, "cudnn": None, "in_progress": False})
            toolkits[path]["nvcc"] = parse_nvcc_version(text)
        elif kind == "cudnn":
            toolkits.setdefault(path, {"nvcc": None, "cudnn": None, "in_progress": False})
            toolkits[path]["cudnn"] = parse_cudnn_version_header(text)
        elif kind == "in-progress":
            toolkits.setdefault(path, {"nvcc": None, "cudnn": None, "in_progress": False})
            toolkits[path]["in_progress"] = True
    return {"link": link, "toolkits": toolkits}


class CudaHostCompiler(FactBase[dict[str, str | None]]):
    """The default ``gcc`` version and whether ``gcc-11``/``g++-11`` are on the box.

    Returns ``{"gcc": "12.2.0" or None, "gcc-11": "/usr/bin/gcc-11" or None, "g++-11": ... }``;
    all None (the default) where none is there.
    """

    @staticmethod
    def default() -> dict[str, str | None]:
        return {"gcc": None, "gcc-11": None, "g++-11": None}

    def command(self) -> str:
        return (
            "echo \"gcc=$(gcc -dumpfullversion -dumpversion 2>/dev/null)\"; "
            "echo \"gcc-11=$(command -v gcc-11 2>/dev/null)\"; "
            "echo \"g++-11=$(command -v g++-11 2>/dev/null)\"; true"
        )

    def process(self, output) -> dict[str, str | None]:
        found = self.default()
        for line in output:
            key, sep, value = line.strip().partition("=")
            if sep and key in found:
                found[key] = value.strip() or None
        return found
