"""Stage: the Python env (conda or venv) with torch cu118, Apex, vLLM (and the cu118 build of its
xformers) where the GPU allows, and the patched verl 0.5.0, proven on the box and rebuilt safely
when broken.

Layout on the box (env_prefix = /opt/verl-lab/envs/verl by default):

    <env_prefix>          symlink -> <env_prefix>.genN   (the env everyone uses)
    <env_prefix>.prev     symlink -> the generation before (kept until a newer one passes)
    <env_prefix>.genN/    a real env; its verl-lab-constraints.txt pins torch and verl's deps

A build (files/templates/env-build.sh.j2) always makes a new generation beside the current
one, proves it with files/templates/env-prove.py, and only then swaps the link (rename of a
symlink: atomic). A failed build leaves the link where it was. The stage builds when the
``PythonEnv`` fact finds no env, a broken one, or one built from another plan (stamp);
deploy/rebuild.py builds a new generation unconditionally.

The stage has tasks/cuda.py's shape: the box's facts in one command (``gather_facts`` ->
``EnvFacts``), pure planning (``plan_env``, ``env_decision``, ``env_wanted``) unit-tested on
plain values, and ``install_env``, which only turns the plan into operations.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation
from pyinfra.operations import apt

from tasks.artifacts import artifact_file, box_path
from tasks.catalog import REPO_ROOT
from tasks.facts.bundle import ask
from tasks.facts.env import BuildHost, PythonEnv, VerlCheckout
from tasks.facts.files import Marker, PathStates
from tasks.facts.gpu import parse_compute_capability
from tasks.failure import fail_host
from tasks.placed import OnBox, marker_command, place, rendered, wanted_dir, wanted_file
from tasks.plan import PlanError, plan_overrides_for_host
from tasks.settings import LabSettings
from tasks.target import HostTarget
from tasks.verl.source import box_patch_paths, checkout_done, patch_wanted, verl_source

REQUIREMENTS = REPO_ROOT / "files" / "requirements" / "verl-0.5.0.txt"
# the proofs' sibling, placed beside prove-env.py under its own name (env_prove.py imports it so)
LOCK_MODULE = REPO_ROOT / "verl_lab_box" / "env_lock.py"
LOCK_CHECK = LOCK_MODULE.name
BUILD_TOOLS = REPO_ROOT / "files" / "requirements" / "build-tools.txt"
TEMPLATES = REPO_ROOT / "files" / "templates"
CONDA_PYTHON = "3.10"
MIN_PYTHON = (3, 10)
# The Apex build passes two --config-settings of one key: pip < 23.1 refuses the option (22.0.2,
# Ubuntu 22.04's venv) or keeps only the last value (23.0.1, Debian 12's venv).
MIN_PIP = (23, 1)
KIB_PER_BUILD_JOB = 4 * 1024 * 1024          # Apex's nvcc jobs: about 4 GB of RAM each
# TORCH_CUDA_ARCH_LIST for a box without a GPU: what torch 2.6 cu118 itself is built for (>= 6.0).
NO_GPU_ARCH_LIST = "6.0;7.0;7.5;8.0;8.6;9.0"
NO_CUDA = "none"                             # the torch artifact's cuda under a CPU stand-in


class EnvPlanError(ValueError):
    """The catalog's Python-stack entries cannot make a plan (a fix is in the message)."""


# ------------------------------------------------------------------ pure planning

def requirement_lines(path: Path) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()
            if line.split("#", 1)[0].strip()]


def pinned_version(requirements: list[str], name: str, where: str = "the torch artifact's requirements") -> str:
    """The version pinned for ``name`` (``torch==2.6.0+cu118`` -> ``2.6.0+cu118``)."""
    for req in requirements:
        left, sep, version = req.partition("==")
        if sep and left.split("[", 1)[0].strip().lower() == name.lower():
            return version.strip()
    raise EnvPlanError(f"{where} {requirements!r} pin no {name}==<version>;"
                       f" list exact pins such as {name}==2.6.0+cu118")


def env_pip_version(build_tools: Path = BUILD_TOOLS) -> str:
    """The pip every new env is brought to first (build-tools.txt), refused below ``MIN_PIP``."""
    version = pinned_version(requirement_lines(build_tools), "pip", f"{build_tools.name}'s requirements")
    have = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if have < MIN_PIP:
        need = ".".join(map(str, MIN_PIP))
        raise EnvPlanError(f"{build_tools.name} pins pip=={version}; the Apex build's repeated --config-settings"
                           f" need pip >= {need}: pin a newer pip")
    return version


def constraint_lines(torch_requirements: list[str], *requirement_files: Path) -> list[str]:
    """Constraints: the torch pins, then every pin of the given files (extras dropped: pip refuses them)."""
    lines = list(torch_requirements)
    names = {r.partition("==")[0].strip().lower() for r in lines}
    for path in requirement_files:
        for req in requirement_lines(path):
            name, sep, version = req.partition("==")
            if not sep:
                raise EnvPlanError(f"{path.name}: {req!r} is not pinned with ==")
            bare = name.split("[", 1)[0].strip()
            if bare.lower() not in names:
                lines.append(f"{bare}=={version.strip()}")
                names.add(bare.lower())
    return lines


def vllm_decision(gpu_cc: str | None, min_cc: str, rollout: str = "auto") -> tuple[bool, str]:
    """Install vLLM? Only where the GPU's compute capability is at least ``min_cc``, and not where
    ``workload.rollout`` is ``hf``: that box trains with the HF rollout, so an env whose vLLM wheel
    would not load still gets built and proven."""
    if rollout == "hf":
        return False, "workload.rollout = 'hf': the HF-transformers rollout trains, vLLM is not installed"
    if not gpu_cc:
        return False, "no usable NVIDIA GPU on this box (vLLM needs one with compute capability >= " f"{min_cc})"
    have, need = parse_compute_capability(gpu_cc), parse_compute_capability(min_cc)
    if have < need:
        return False, f"compute capability {gpu_cc} < {min_cc}: vLLM 0.8.5 does not support this GPU (the HF rollout is used)"
    return True, f"compute capability {gpu_cc} >= {min_cc}"


def xformers_decision(want_vllm: bool, gpu_cc: str | None) -> tuple[bool, str]:
    """Install the catalog's cu118 xformers before vLLM? On every box that gets vLLM.

    vLLM 0.8.5 requires xformers==0.0.29.post2 on every x86_64 box, and PyPI (a CUDA 12.4 build,
    whose ops cannot load beside torch cu118) and the cu118 index serve files of that one name:
    left to vLLM's install, pip's tie-break between the two indexes picks the build. On 7.x its
    ops are what vLLM's V0 engine attends with. On 8.0+ vLLM's V1 engine does not use xformers,
    but the same cu118 build is pinned there too: it costs nothing (vLLM installs xformers
    anyway), every env holds the same files whatever the index order, and a fall-back to V0 or
    an xformers attention backend chosen by hand finds ops that load.
    """
    if not want_vllm:
        return False, "no vLLM on this box (xformers comes with vLLM only)"
    if parse_compute_capability(gpu_cc) < (8, 0):
        return True, (f"compute capability {gpu_cc} < 8.0: vLLM 0.8.5 runs its V0 engine, whose attention is"
                      " xformers: the cu118 build is installed from the PyTorch cu118 index (PyPI's is CUDA 12.4)")
    return True, (f"compute capability {gpu_cc} >= 8.0: vLLM's V1 engine does not use xformers, but vLLM 0.8.5"
                  " requires it: the same cu118 build is pinned so pip's tie-break cannot pick PyPI's CUDA 12.4 one")


def torch_cuda_arch_list(arch_list: str | None) -> str:
    """Build for this box's GPUs only (far faster: every compute capability it has, e.g. "6.1;8.6" on
    a box mixing a P40 and an RTX 3090); a GPU-less box gets torch's own list."""
    return arch_list if arch_list else NO_GPU_ARCH_LIST


def build_jobs(mem_total_kib: int | None, cpus: int | None) -> int:
    """MAX_JOBS: one job per 4 GB of RAM, no more than the CPUs, at least 1."""
    by_ram = (mem_total_kib or 0) // KIB_PER_BUILD_JOB
    return max(1, min(by_ram, cpus or 1))


def stamp_of(data: dict) -> str:
    """What a generation was built from; a different stamp means the env must be rebuilt."""
    blob = json.dumps(data, sort_keys=True).encode()
    for path in (REQUIREMENTS, BUILD_TOOLS, TEMPLATES / "env-build.sh.j2"):
        blob += path.read_bytes()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class EnvPlan:
    backend: str
    python_version: str | None          # conda: the version to create; venv: what the interpreter is
    torch_requirements: tuple[str, ...]
    torch_version: str
    cuda: str                           # torch.version.cuda to prove, or "none" (CPU stand-in)
    torch_index: str
    pypi_index: str
    constraints: tuple[str, ...]
    pip_version: str                    # brought into the env first (build-tools.txt)
    apex_url: str
    apex_ref: str
    arch_list: str
    max_jobs: int
    cc: str | None
    cxx: str | None
    gpu_cc: str | None
    vllm: bool
    vllm_reason: str
    vllm_version: str
    xformers: bool
    xformers_reason: str
    xformers_requirements: tuple[str, ...]
    xformers_version: str
    xformers_index: str
    xformers_cuda: str
    verl_version: str
    compose_overrides: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()      # why this box cannot get an env (fails this box only)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def expect(self) -> dict:
        """What env-prove.py checks (also the PythonEnv fact's argument)."""
        return {
            "torch": self.torch_version, "cuda": self.cuda, "gpu_cc": self.gpu_cc,
            "vllm": self.vllm_version if self.vllm else None,
            "vllm_skip": None if self.vllm else self.vllm_reason,
            "xformers": self.xformers_version if self.xformers else None,
            "xformers_skip": None if self.xformers else self.xformers_reason,
            "xformers_cuda": self.xformers_cuda, "xformers_index": self.xformers_index,
            "verl": self.verl_version, "compose": True, "overrides": list(self.compose_overrides),
            # the env's lock: every pin, checked with what each needs (verl_lab_box/env_lock.py)
            "lock": list(self.constraints),
        }

    @property
    def stamp(self) -> str:
        data = asdict(self)
        for key in ("notes", "problems", "compose_overrides", "vllm_reason", "xformers_reason"):
            data.pop(key)
        return stamp_of(data)


@dataclass(frozen=True)
class EnvFacts:
    """What the box has now, asked in one command (``gather_facts``; fakes in unit tests)."""

    build: dict                               # BuildHost: python, conda, nvcc, headers, RAM, CPUs
    states: dict                              # PathStates of every path the stage places
    checkout: dict | None                     # VerlCheckout: ref and patches of the verl source
    marker: dict | None                       # Marker(settings.marker("env"))


def compose_overrides(gpu: HostTarget, settings: LabSettings) -> tuple[tuple[str, ...], str | None]:
    """The host's own training plan's overrides for the compose proof (its settings, its GPU
    target), and a note when there is no plan to compose (then verl's config is composed bare)."""
    if gpu.target is None:
        return (), f"no GPU target ({gpu.problem}): the compose proof checks verl's config without a plan"
    try:
        return tuple(plan_overrides_for_host(gpu.target, settings)), None
    except PlanError as exc:
        return (), (f"no training plan for {gpu.target.count} x {gpu.target.name} ({exc}): the compose proof "
                    "checks verl's config without a plan")


def plan_env(settings: LabSettings, gpu: HostTarget, build: dict, overrides: tuple[str, ...] = ()) -> EnvPlan:
    """Decide the env for one box from its settings, its GPU target (tasks/target.py: the box's
    GPUs or its gpu_override) and its BuildHost fact."""
    cat = settings.catalog
    torch = cat.artifact("torch")
    reqs = list(torch.get("requirements") or [])
    if not reqs:
        raise EnvPlanError("catalog artifact torch has no requirements list")
    cuda = str(torch.get("cuda") or "")
    if not cuda:
        raise EnvPlanError("catalog artifact torch has no cuda (the torch.version.cuda to prove, or 'none')")
    torch_version = pinned_version(reqs, "torch")
    apex = cat.artifact("apex")
    vllm = cat.artifact("vllm")
    verl = cat.artifact("verl")
    gpu_cc = gpu.compute_capability
    want_vllm, why = vllm_decision(gpu_cc, str(vllm.get("min_compute_capability", "7.0")),
                                   settings.workload["rollout"])
    xformers = cat.artifact("xformers")
    xformers_reqs = list(xformers.get("requirements") or [])
    xformers_version = pinned_version(xformers_reqs, "xformers", "the xformers artifact's requirements")
    want_xformers, xformers_why = xformers_decision(want_vllm, gpu_cc)
    # the host compiler is decided once for the host (tasks/target.py; the base stage installs gcc-11)
    cc, cxx = (gpu.compiler.cc, gpu.compiler.cxx) if gpu.compiler.needed else (None, None)
    problems, notes = [], []
    if settings.env_backend == "venv":
        version = build.get("python_version")
        if not version:
            problems.append(f"venv_python {settings.venv_python!r} does not run on this box;"
                            " set venv_python to a Python >= 3.10 that is installed")
        elif tuple(int(x) for x in version.split(".")) < MIN_PYTHON:
            problems.append(f"venv_python {settings.venv_python!r} is Python {version}; verl 0.5.0 needs >= 3.10:"
                            " set venv_python to a newer interpreter or use env_backend = 'conda'")
        python_version = version
    else:
        python_version = CONDA_PYTHON
    if cuda != NO_CUDA:
        nvcc = build.get("nvcc_release")
        if not nvcc:
            problems.append(f"no nvcc at {settings.cuda_prefix}/bin/nvcc: Apex builds against the CUDA toolkit;"
                            " run the CUDA stage first (deploy/cuda.py) or set cuda_prefix")
        elif nvcc != cuda:
            problems.append(f"nvcc at {settings.cuda_prefix} is release {nvcc}, torch is built for CUDA {cuda}:"
                            " Apex refuses to build with mismatched versions; point cuda_prefix at CUDA " + cuda)
    else:
        notes.append("torch is a CPU stand-in (catalog torch.cuda = 'none'): CUDA checks are reported as skipped")
    if not gpu_cc:
        notes.append(f"no usable GPU: Apex is built for TORCH_CUDA_ARCH_LIST={NO_GPU_ARCH_LIST}")
    return EnvPlan(
        backend=settings.env_backend,
        python_version=python_version,
        torch_requirements=tuple(reqs),
        torch_version=torch_version,
        cuda=cuda,
        torch_index=torch.url(settings.mirrors),
        pypi_index=settings.mirrors.base("pypi"),
        # xformers pinned too where it is installed, so vLLM's install keeps the cu118 build
        constraints=tuple(constraint_lines(reqs + (xformers_reqs if want_xformers else []),
                                           REQUIREMENTS, BUILD_TOOLS)),
        pip_version=env_pip_version(),
        apex_url=apex.url(settings.mirrors),
        apex_ref=str(apex.ref),
        arch_list=torch_cuda_arch_list(gpu.target.arch_list if gpu.target else None),
        max_jobs=build_jobs(build.get("mem_total_kib"), build.get("cpus")),
        cc=cc,
        cxx=cxx,
        gpu_cc=gpu_cc,
        vllm=want_vllm,
        vllm_reason=why,
        vllm_version=vllm.version,
        xformers=want_xformers,
        xformers_reason=xformers_why,
        xformers_requirements=tuple(xformers_reqs),
        xformers_version=xformers_version,
        xformers_index=xformers.url(settings.mirrors),
        xformers_cuda=str(xformers.get("cuda") or ""),
        verl_version=verl.version,
        compose_overrides=tuple(overrides),
        problems=tuple(problems),
        notes=tuple(notes),
    )


def build_dir(settings: LabSettings) -> str:
    """Where the env stage keeps its build script, constraints and proofs on the box."""
    return f"{settings.lab_root}/env-build"


def conda_bin(settings: LabSettings) -> str:
    return f"{settings.conda_prefix}/bin/conda"


def build_script_context(settings: LabSettings, plan: EnvPlan, vllm_wheel: str | None) -> dict:
    """Everything env-build.sh.j2 needs; ``q`` holds the shell-quoted values."""
    d = build_dir(settings)
    values = {
        "env_prefix": settings.env_prefix,
        "build_dir": d,
        "stamp": plan.stamp,
        "conda": conda_bin(settings),
        "python_version": plan.python_version or CONDA_PYTHON,
        "venv_python": settings.venv_python,
        "constraints": f"{d}/constraints.txt",
        "pypi_index": plan.pypi_index,
        "torch_index": plan.torch_index,
        "pip_cache": f"{settings.box_cache}/pip",
        "build_tools": f"{d}/build-tools.txt",
        "pip_requirement": f"pip=={plan.pip_version}",
        "min_pip": ".".join(map(str, MIN_PIP)),
        "tmpdir": settings.install_tmpdir,
        "apex_ref": plan.apex_ref,
        "apex_url": plan.apex_url,
        "cuda_prefix": settings.cuda_prefix,
        "torch_cuda_arch_list": plan.arch_list,
        "cc": plan.cc or "",
        "cxx": plan.cxx or "",
        "verl_requirements": f"{d}/verl-requirements.txt",
        "vllm_wheel": vllm_wheel or "",
        "vllm_skip_message": f"verl-lab: vLLM not installed: {plan.vllm_reason}",
        "xformers_index": plan.xformers_index,
        "verl_src": settings.verl_src,
        "prove": f"{d}/prove-env.py",
        "expect": json.dumps({**plan.expect, "verl_src": settings.verl_src}, sort_keys=True),
    }
    q = {k: shlex.quote(str(v)) for k, v in values.items()}
    q["torch_requirements"] = " ".join(shlex.quote(r) for r in plan.torch_requirements)
    q["xformers_requirements"] = " ".join(shlex.quote(r) for r in plan.xformers_requirements)
    return {
        "q": q,
        "backend": plan.backend,
        "cc": plan.cc,
        "max_jobs": int(plan.max_jobs),
        "vllm_wheel": vllm_wheel,
        "xformers": plan.xformers,
        "xformers_comment": plan.xformers_reason,
        "write_marker": env_marker_command(settings, plan, OnBox("$name")),
    }


def env_marker_command(settings: LabSettings, plan: EnvPlan, generation: str) -> str:
    """The env marker (tasks.placed.marker_command): written by the build script after its proofs
    (``generation`` the box's ``$name``), or alone for a healthy env of this plan that lost it."""
    return marker_command(settings.marker("env"), [
        ("generation", generation), ("stamp", plan.stamp), ("backend", plan.backend),
        ("python", plan.python_version or ""), ("torch", plan.torch_version), ("cuda", plan.cuda),
        ("apex", plan.apex_ref), ("torch_cuda_arch_list", plan.arch_list), ("max_jobs", plan.max_jobs),
        ("vllm", plan.vllm_version if plan.vllm else "skipped"), ("vllm_reason", plan.vllm_reason),
        ("xformers", plan.xformers_version if plan.xformers else "skipped"),
        ("xformers_reason", plan.xformers_reason), ("verl", plan.verl_version),
        # verl-lab installs no flash-attn: the training plan reads this and keeps sdpa.
        ("flash_attn", 0),
    ], drop=settings.legacy_marker("env"))


def expect_for(settings: LabSettings, plan: EnvPlan) -> dict:
    return {**plan.expect, "verl_src": settings.verl_src}


def env_decision(env: dict | None, plan: EnvPlan, marker: dict | None, force: bool = False) -> tuple[str, str]:
    """("ok" | "marker" | "build", why) from the PythonEnv fact, the plan and the stage marker."""
    if force:
        return "build", "rebuild requested"
    if not env or not env.get("present"):
        return "build", "no env yet"
    if not env.get("healthy"):
        details = "; ".join(f"{n}: {env['checks'].get(n, {}).get('detail', '?')}" for n in env.get("broken", []))
        return "build", f"the env is broken ({details})"
    if env.get("stamp") != plan.stamp:
        return "build", f"the env was built from another plan (stamp {env.get('stamp')} != {plan.stamp})"
    if not marker or marker.get("stamp") != plan.stamp:
        return "marker", "the env is healthy but its marker is missing"
    return "ok", f"healthy env {env.get('target')} (torch {plan.torch_version}, verl {plan.verl_version})"


# ------------------------------------------------------------------ the pyinfra stage


@operation()
def miniforge(settings: LabSettings, installer: str):
    """Install Miniforge non-interactively into conda_prefix (once)."""
    build = host.get_fact(BuildHost, venv_python=settings.venv_python, conda_prefix=settings.conda_prefix,
                          cuda_prefix=settings.cuda_prefix)
    if build["conda"]:
        host.noop(f"conda already at {settings.conda_prefix}")
        return
    yield StringCommand("bash", shlex.quote(installer), "-b", "-p", shlex.quote(settings.conda_prefix))


@operation()
def env_generation(settings: LabSettings, plan: EnvPlan, script: str, force: bool = False):
    """
    Build, prove and swap in a new env generation, unless the current env is healthy and
    built from this plan (then nothing; a missing marker alone is rewritten).
    """
    marker = host.get_fact(Marker, path=settings.marker("env"), legacy=settings.legacy_marker("env"))
    expect = expect_for(settings, plan)
    if not force and marker and marker.get("stamp") == plan.stamp and settings.env_health_check == "quick":
        # This env passed every proof (imports, GPU, config compose) when it was built from
        # this plan. A re-run re-checks what breaks in place without importing anything:
        # versions, every installed file against its RECORD, Apex's extension files, verl's
        # patched source (files/templates/env-prove.py, "quick"). A change of plan (a new
        # stamp), deploy/rebuild.py and env_health_check = "full" prove everything again.
        expect = {**expect, "quick": True}
    env = host.get_fact(PythonEnv, prefix=settings.env_prefix, expect=expect)
    action, why = env_decision(env, plan, marker, force)
    if action == "ok":
        host.noop(why)
        return
    if action == "marker":
        yield StringCommand("sh", "-c", shlex.quote(env_marker_command(settings, plan, env.get("target"))))
        return
    # said without -v, when the build starts (minutes): why this box's env is built again
    host.log_styled(f"verl-lab env: building a new env generation beside the current one: {why}", fg="yellow",
                    log_func=logger.warning)
    yield StringCommand("echo", shlex.quote(f"verl-lab: building a new env generation: {why}"))
    yield StringCommand("bash", shlex.quote(script))


def env_file_paths(settings: LabSettings) -> list[str]:
    """The paths of ``env_wanted``, known before the plan is made (asked in the stage's one
    bundle; tests/unit/test_placed.py checks the two agree)."""
    d = build_dir(settings)
    paths = [d, settings.install_tmpdir, f"{settings.box_cache}/pip", str(Path(settings.env_prefix).parent),
             *(w.path for w in patch_wanted(settings)),
             *(f"{d}/{name}" for name in ("constraints.txt", "verl-requirements.txt", "build-tools.txt",
                                          "prove-env.py", LOCK_CHECK, "build-env.sh"))]
    if settings.env_backend == "conda":
        paths.append(f"{settings.conda_prefix}/.condarc")
    return paths


def env_wanted(settings: LabSettings, plan: EnvPlan, vllm_wheel: str | None) -> tuple[list, list]:
    """The folders and files the env stage places (tasks/placed.py), and the conda box's .condarc
    (placed apart: after Miniforge, whose installer refuses an existing prefix)."""
    d = build_dir(settings)
    wanted = [
        *(wanted_dir(path) for path in (d, settings.install_tmpdir, f"{settings.box_cache}/pip",
                                        str(Path(settings.env_prefix).parent))),
        *patch_wanted(settings),
        wanted_file(f"{d}/constraints.txt", "Env constraints",
                    rendered(TEMPLATES / "env-constraints.txt.j2", lines=list(plan.constraints))),
        wanted_file(f"{d}/verl-requirements.txt", "verl runtime requirements", REQUIREMENTS.read_bytes()),
        wanted_file(f"{d}/build-tools.txt", "Build tools requirements", BUILD_TOOLS.read_bytes()),
        wanted_file(f"{d}/prove-env.py", "Env proofs", (REPO_ROOT / "verl_lab_box" / "env_prove.py").read_bytes()),
        wanted_file(f"{d}/{LOCK_CHECK}", "Env lock check (imported by the proofs)", LOCK_MODULE.read_bytes()),
        wanted_file(f"{d}/build-env.sh", "Env build script",
                    rendered(TEMPLATES / "env-build.sh.j2", **build_script_context(settings, plan, vllm_wheel)),
                    mode="755"),
    ]
    condarc = []
    if settings.env_backend == "conda":
        condarc = [wanted_file(f"{settings.conda_prefix}/.condarc", "conda channels (.condarc)",
                               rendered(TEMPLATES / "condarc.j2", profile=settings.mirror_profile,
                                        conda_base=settings.mirrors.base("conda")))]
    return wanted, condarc


def gather_facts(settings: LabSettings) -> EnvFacts:
    """The box's facts for the env stage, in one command (tasks/facts/bundle.py)."""
    art = settings.catalog.artifact("verl")
    build, states, checkout, marker = ask(
        (BuildHost, {"venv_python": settings.venv_python, "conda_prefix": settings.conda_prefix,
                     "cuda_prefix": settings.cuda_prefix}),
        (PathStates, {"paths": env_file_paths(settings)}),
        (VerlCheckout, {"path": settings.verl_src, "ref": art.ref,
                        "patches": box_patch_paths(settings, art.version)}),
        (Marker, {"path": settings.marker("env"), "legacy": settings.legacy_marker("env")}),
    )
    return EnvFacts(build=build, states=states or {}, checkout=checkout, marker=marker)


@deploy("verl-lab Python env")
def install_env(settings: LabSettings, gpu: HostTarget, force_rebuild: bool = False):
    """The env stage: prerequisites, verl source, the build inputs, then env_generation.

    ``gpu``: the host's GPU target (tasks/target.py), decided before the stages. A re-run on a
    box whose env is as planned costs two commands: one fact bundle (the build host, every file
    the stage places, the verl checkout, the marker), then the env's quick re-check (PythonEnv).
    Anything else queues the operations, which read the box again when they run.
    """
    facts = gather_facts(settings)
    overrides, compose_note = compose_overrides(gpu, settings)
    plan = plan_env(settings, gpu, facts.build, overrides)
    if compose_note:
        plan = replace(plan, notes=plan.notes + (compose_note,))
    for note in plan.notes:
        host.noop(f"env: {note}")
    if plan.problems:
        fail_host(name="Python env prerequisites", message="; ".join(plan.problems), stage="env")
        return
    vllm_wheel = box_path(settings, settings.catalog.artifact("vllm")) if plan.vllm else None
    script = f"{build_dir(settings)}/build-env.sh"
    wanted, condarc = env_wanted(settings, plan, vllm_wheel)
    placed = place(wanted, facts.states)

    packages = []
    if settings.env_backend == "venv" and not facts.build["python_headers"]:
        packages += [f"python{plan.python_version}-dev"]
    if packages:
        apt.packages(name=f"Build packages ({', '.join(packages)})", packages=packages, update=True)

    if settings.env_backend == "conda":
        installer = box_path(settings, settings.catalog.artifact("miniforge_installer"))
        artifact_file(name="Miniforge installer", settings=settings, artifact="miniforge_installer")
        miniforge(name=f"Miniforge at {settings.conda_prefix}", settings=settings, installer=installer)
        placed.update(place(condarc, facts.states))     # after Miniforge: its installer refuses an existing prefix

    patches_current = all(placed[w.path] is None for w in patch_wanted(settings))
    verl_done = patches_current and checkout_done(settings, facts.checkout)
    verl_source(settings, done=verl_done)

    if plan.vllm:
        artifact_file(name="vLLM wheel", settings=settings, artifact="vllm")
    else:
        host.noop(f"vLLM skipped: {plan.vllm_reason}")

    name = "Python env (build, prove, swap)" if force_rebuild else "Python env"
    marker = facts.marker
    quick = bool(marker) and marker.get("stamp") == plan.stamp and settings.env_health_check == "quick"
    if quick and verl_done and not force_rebuild and all(why is None for why in placed.values()):
        # nothing before it changes this run: decide now, and skip the operation when the
        # quick re-check passes (a failing one leaves the decision to the operation)
        env = host.get_fact(PythonEnv, prefix=settings.env_prefix, expect={**expect_for(settings, plan), "quick": True})
        action, why = env_decision(env, plan, marker)
        if action == "ok":
            host.noop(f"{name}: {why}")
            return
        # the quick re-check failed: the operation's name (printed while the build runs, minutes) says why
        name = f"Python env: {'rebuilt' if action == 'build' else 'marker rewritten'} ({why})"
    env_generation(name=name, settings=settings, plan=plan, script=script, force=force_rebuild)
