"""Facts of the Python-env stage: the env's health, the verl checkout, the build host.

``PythonEnv`` runs the env's own proofs (verl_lab_box/env_prove.py after its sibling env_lock.py, sent
on stdin so it works before anything was uploaded) and answers what is healthy and what is broken.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from pyinfra.api import FactBase

from tasks.catalog import REPO_ROOT

PROVE_SCRIPT = REPO_ROOT / "verl_lab_box" / "env_prove.py"
# its sibling (the lock and the trainer's imports), sent first in the same program: env_prove.py then finds
# its names in its own module (nothing of either is on the box before the env stage places them)
LOCK_SCRIPT = REPO_ROOT / "verl_lab_box" / "env_lock.py"
_EOF = "VERL_LAB_PROVE_EOF"


def _sections(output) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in output:
        key, sep, value = line.partition("=")
        if sep and key.isidentifier():
            found[key] = value.strip()
    return found


def parse_env_output(lines: list[str]) -> dict:
    """Turn PythonEnv's output into {present, target, prev, stamp, healthy, broken, checks}."""
    lines = [line.rstrip("\n") for line in lines]
    if not lines or lines[0].strip() == "absent":
        return {"present": False, "target": None, "prev": None, "stamp": None,
                "healthy": False, "broken": ["env"], "checks": {}}
    head = _sections(line for line in lines if not line.startswith("{"))
    proof_lines = [line for line in lines if line.startswith("{")]
    try:
        proof = json.loads(proof_lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = " | ".join(line for line in lines if not line.startswith(("target=", "prev=", "stamp=")))[-300:]
        proof = {"healthy": False, "broken": ["python"],
                 "checks": {"python": {"ok": False, "detail": f"the env's python did not run the proofs: {tail}"}}}
    return {
        "present": True,
        "target": head.get("target") or None,
        "prev": head.get("prev") or None,
        "stamp": head.get("stamp") or None,
        "healthy": bool(proof.get("healthy")),
        "broken": list(proof.get("broken", [])),
        "checks": proof.get("checks", {}),
    }


class PythonEnv(FactBase[dict]):
    """The env at ``prefix``: which generation it links to, its build stamp, and each proof.

    Returns ``{"present", "target", "prev", "stamp", "healthy", "broken", "checks"}``;
    ``broken`` names the failed proofs (torch, torch_cuda, gpu, apex, vllm, verl, compose).
    The default, without an env: ``present`` False, ``broken`` ``["env"]``.
    """

    @staticmethod
    def default() -> dict:
        return parse_env_output([])

    def command(self, prefix: str, expect: dict) -> str:
        p = shlex.quote(prefix)
        program = LOCK_SCRIPT.read_text() + "\n" + PROVE_SCRIPT.read_text()
        return (
            f"if [ ! -x {p}/bin/python ]; then echo absent; exit 0; fi; "
            f"echo target=$(readlink {p} 2>/dev/null); echo prev=$(readlink {p}.prev 2>/dev/null); "
            f"echo stamp=$(cat {p}/verl-lab-env.stamp 2>/dev/null); "
            f"{p}/bin/python - {shlex.quote(json.dumps(expect, sort_keys=True))} 2>&1 <<'{_EOF}' || true\n"
            f"{program}\n{_EOF}\n"
        )

    def process(self, output) -> dict:
        return parse_env_output(list(output))


def parse_checkout_output(lines: list[str]) -> dict | None:
    head = _sections(line for line in lines if not line.startswith("patch:"))
    if head.get("exists") != "1":
        return None
    patches = {}
    for line in lines:
        if line.startswith("patch:"):
            name, _, state = line[len("patch:"):].partition("=")
            patches[name] = state.strip()
    return {"head": head.get("head") or None, "tag_commit": head.get("tag") or None,
            "at_ref": bool(head.get("head")) and head.get("head") == head.get("tag"), "patches": patches}


class VerlCheckout(FactBase[dict | None]):
    """The verl clone at ``path``: HEAD, the commit of tag ``ref``, and each patch's state.

    Returns None (the default) without a clone, else ``{"head", "tag_commit", "at_ref", "patches"}`` where
    ``patches`` maps a patch file name to ``applied`` | ``applicable`` | ``conflict`` | ``missing``
    (``missing``: the patch file is not on the box yet).
    """

    def command(self, path: str, ref: str, patches: list[str]) -> str:
        p = shlex.quote(path)
        parts = [
            f"if [ ! -d {p}/.git ]; then echo exists=0; exit 0; fi",
            "echo exists=1",
            f"echo head=$(git -C {p} rev-parse HEAD 2>/dev/null)",
            f"echo tag=$(git -C {p} rev-parse -q --verify {shlex.quote('refs/tags/' + ref + '^{commit}')} 2>/dev/null)",
        ]
        for patch in patches:
            f, name = shlex.quote(patch), shlex.quote(Path(patch).name)
            parts.append(
                f"if [ ! -f {f} ]; then echo patch:{name}=missing; "
                f"elif git -C {p} apply --reverse --check {f} 2>/dev/null; then echo patch:{name}=applied; "
                f"elif git -C {p} apply --check {f} 2>/dev/null; then echo patch:{name}=applicable; "
                f"else echo patch:{name}=conflict; fi"
            )
        return "; ".join(parts)

    def process(self, output) -> dict | None:
        return parse_checkout_output(list(output))


def parse_build_host(lines: list[str]) -> dict:
    head = _sections(lines)

    def num(key):
        value = head.get(key, "")
        return int(value) if value.isdigit() else None

    return {
        "mem_total_kib": num("mem_kib"),
        "cpus": num("cpus"),
        "python_version": head.get("python") or None,
        "python_headers": head.get("python_h") == "1",
        "conda": head.get("conda") == "1",
        "nvcc_release": head.get("nvcc") or None,
    }


class BuildHost(FactBase[dict]):
    """What the env build needs from the box: RAM, CPUs, Python, conda, nvcc (the host compiler
    is the host target's, tasks/target.py).

    Returns ``{"mem_total_kib", "cpus", "python_version",
    "python_headers", "conda", "nvcc_release"}`` (python_*: the venv interpreter's); the
    default, nothing read: every value None or False.
    """

    @staticmethod
    def default() -> dict:
        return parse_build_host([])

    def command(self, venv_python: str, conda_prefix: str, cuda_prefix: str) -> str:
        py = shlex.quote(venv_python)
        conda = shlex.quote(f"{conda_prefix}/bin/conda")
        nvcc = shlex.quote(f"{cuda_prefix}/bin/nvcc")
        probe = ("import sys, sysconfig, os; print('python=%d.%d' % sys.version_info[:2]); "
                 "print('python_h=%d' % os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))")
        return "; ".join([
            "echo mem_kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)",
            "echo cpus=$(nproc)",
            f"{py} -c {shlex.quote(probe)} 2>/dev/null || true",
            f"if [ -x {conda} ]; then echo conda=1; fi",
            f"if [ -x {nvcc} ]; then echo nvcc=$({nvcc} --version | sed -n 's/.*release \\([0-9.]*\\).*/\\1/p'); fi",
        ])

    def process(self, output) -> dict:
        return parse_build_host(list(output))
