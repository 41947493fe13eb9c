"""Stage: the CUDA 11.8 toolkit and cuDNN 8.9.7, side by side with any other CUDA.

The runfile installs the toolkit only into ``settings.cuda_prefix``; cuDNN's CUDA 11 archive is
copied into the same prefix (``include/`` -> include, ``lib/`` -> lib64, symlinks kept).
``/usr/local/cuda`` and every other toolkit are left exactly as they were.

Everything that decides is a pure function of facts (``plan_cuda``); ``install_cuda`` only
turns the plan into operations. The box-side work is one rendered script
(files/templates/cuda-install.sh.j2), run only when the plan says there is work.

Disk thresholds (MiB), checked per filesystem and summed where the paths share one:

* ``install_tmpdir``: ``TMPDIR_NEED_MIB`` = 10240. The runfile unpacks its whole payload
  (~4.3 GB compressed) there before copying; NVIDIA's own advice is a tmpdir with >10 GB free.
* ``cuda_prefix``: ``PREFIX_NEED_MIB`` = 8192. The 11.8 toolkit installs to ~6 GB and cuDNN
  8.9.7's libraries add ~2 GB.
* the box cache (``lab_root``/cache): the runfile and the cuDNN archive themselves (catalog
  ``size``, else ``approx_mib``), unless already there and verified.

After a verified install the runfile and the cuDNN archive are deleted from the box cache
(~5 GB back): a re-run decides from the marker and the toolkit's own proofs and never needs
them; a repair fetches them again (relay mode: from the controller's cache, which keeps them).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.server import LinuxDistribution
from pyinfra.operations import files, server

from tasks.artifacts import artifact_file, box_path
from tasks.facts.bundle import ask
from tasks.facts.disk import FreeDisk
from tasks.facts.files import Marker, VerifiedArtifact
from tasks.facts.nvidia import (
    CUDA_LINK,
    IN_PROGRESS,
    CudaToolkits,
    version_tuple,
)
from tasks.failure import fail_host
from tasks.gpu_support import DRIVER_BRANCH_MAX_OLD_GPUS
from tasks.placed import OnBox, marker_command
from tasks.settings import LabSettings
from tasks.target import DISTRO_DEFAULT_GCC, HostCompiler, HostTarget

RUNFILE = "cuda_runfile"
CUDNN = "cudnn_archive"
TEMPLATE = Path(__file__).resolve().parent.parent / "files" / "templates" / "cuda-install.sh.j2"

TMPDIR_NEED_MIB = 10240
PREFIX_NEED_MIB = 8192
INSTALLER_TMP_LOG = "/tmp/cuda-installer.log"   # stale copies crash the runfile
INSTALLER_LOG = "/var/log/cuda-installer.log"
# NVIDIA's runfile writes INSTALLER_TMP_LOG as root, at that fixed path whatever --tmpdir says: in a /tmp anyone can
# write, a link planted there under that name (by the train user's Ray unit, by any local user) would be written
# through. The runfile runs with a /tmp of its own (a mount namespace, a fresh tmpfs); its log stays in /var/log.
PRIVATE_TMP = ("unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
               'mount -t tmpfs -o mode=1777,nosuid,nodev verl-lab-runfile-tmp /tmp && exec "$@"', "runfile")
RUNFILE_FLAGS = ("--silent", "--toolkit", "--no-opengl-libs", "--no-man-page", "--no-drm", "--override")
SYSTEM_DIRS = {"/", "/usr", "/usr/local", "/opt", "/var", "/home", "/root", "/etc", "/tmp", "/var/tmp"}


@dataclass(frozen=True)
class CudaWant:
    """What this host should end up with (from settings and the catalog)."""

    prefix: str
    tmpdir: str
    workdir: str
    box_cache: str
    marker: str
    allow_no_driver: bool
    cuda_version: str       # 11.8.0
    cuda_release: str       # 11.8 (what nvcc prints)
    min_driver: str
    runfile_path: str
    runfile_sha256: str | None
    runfile_mib: int
    cudnn_version: str      # 8.9.7.29
    cudnn_header: str       # 8.9.7 (what cudnn_version.h says)
    cudnn_path: str
    cudnn_sha256: str | None
    cudnn_mib: int
    cudnn_top: str


def _mib(art) -> int:
    if art.size:
        return -(-art.size // (1 << 20))
    return int(art.get("approx_mib", 0))


def cuda_want(settings: LabSettings) -> CudaWant:
    runfile = settings.catalog.artifact(RUNFILE)
    cudnn = settings.catalog.artifact(CUDNN)
    release = ".".join(runfile.version.split(".")[:2])
    return CudaWant(
        prefix=settings.cuda_prefix,
        tmpdir=settings.install_tmpdir,
        workdir=f"{settings.install_tmpdir}/cuda-{runfile.version}",
        box_cache=settings.box_cache,
        marker=settings.marker("cuda"),
        allow_no_driver=settings.allow_no_driver,
        cuda_version=runfile.version,
        cuda_release=release,
        min_driver=str(runfile.get("min_driver")),
        runfile_path=box_path(settings, runfile),
        runfile_sha256=runfile.sha256,
        runfile_mib=_mib(runfile),
        cudnn_version=cudnn.version,
        cudnn_header=".".join(cudnn.version.split(".")[:3]),
        cudnn_path=box_path(settings, cudnn),
        cudnn_sha256=cudnn.sha256,
        cudnn_mib=_mib(cudnn),
        cudnn_top=str(cudnn.get("top_dir")),
    )


@dataclass(frozen=True)
class CudaFacts:
    """What the box has now (fact values, or fakes in unit tests)."""

    os_release: Mapping[str, str]            # /etc/os-release keys (ID, VERSION_ID, ...)
    driver: Mapping | None                    # tasks.facts.gpu.driver_view of the host's GPU fact
    toolkits: Mapping                         # CudaToolkits
    disk: Mapping[str, Mapping | None]        # path -> FreeDisk
    compiler: HostCompiler                    # decided once for the host (tasks/target.py)
    marker: Mapping[str, str] | None          # Marker(settings.marker("cuda"))
    cached: frozenset = frozenset()           # artifact names already verified in the box cache
    driver_stage: str | None = None           # the driver stage installs and proves the driver first


@dataclass(frozen=True)
class CudaPlan:
    action: str                               # refuse | done | adopt | install
    reason: str
    problems: tuple[str, ...] = ()
    host_cc: str = "gcc"
    host_cxx: str = "g++"
    fetch: tuple[str, ...] = ()               # catalog artifacts to put in the box cache
    wipe_partial: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)


# ---------------------------------------------------------------- pre-checks (pure)


def check_distro(os_release: Mapping[str, str]) -> str | None:
    distro, version = os_release.get("ID"), os_release.get("VERSION_ID")
    if (distro, version) in DISTRO_DEFAULT_GCC:   # the distros the runfile is run on
        return None
    name = os_release.get("PRETTY_NAME") or f"{distro or 'unknown'} {version or ''}".strip()
    supported = ", ".join(f"{d.capitalize()} {v}" for d, v in sorted(DISTRO_DEFAULT_GCC))
    return (f"unsupported distribution {name!r} (/etc/os-release ID={distro}, VERSION_ID={version}): "
            f"the CUDA stage supports {supported}. Use one of those, or install CUDA 11.8 yourself "
            "and leave this box out of the cuda stage.")


def _old_gpus(driver: Mapping) -> list[str]:
    """GPUs of this box that only driver branches <= 580 support (Pascal 6.x, Volta 7.0)."""
    old = []
    for gpu in driver.get("gpus") or ():
        cc = gpu.get("compute_cap")
        if cc and version_tuple(cc) < (7, 5):
            old.append(f"{gpu.get('name')} (compute capability {cc})")
    return old


def check_driver(driver: Mapping | None, min_driver: str, allow_no_driver: bool,
                 release: str = "11.8") -> str | None:
    branch_hint = (f"install an NVIDIA driver of branch {min_driver.split('.')[0]} or newer "
                   f"(Pascal and Volta GPUs need branch {DRIVER_BRANCH_MAX_OLD_GPUS} or older, e.g. 535 or 550), "
                   "or set driver = 'install' to let the driver stage choose and install it (docs/driver.md)")
    if driver is None:
        if allow_no_driver:
            return None
        return (f"no NVIDIA driver found (no nvidia-smi, no /proc/driver/nvidia/version). CUDA {release} "
                f"needs driver >= {min_driver} to run. Either {branch_hint}, or set allow_no_driver=True for "
                "this host to install the toolkit anyway (a build box without a GPU).")
    version = driver.get("version")
    if not version:
        if allow_no_driver:
            return None
        return (f"nvidia-smi is installed but reports no driver: {driver.get('error')!r}. The driver is "
                "missing or not loaded (after a driver upgrade: reboot; see `dmesg | grep NVRM`). Fix it, or "
                "set allow_no_driver=True for this host to install the toolkit anyway.")
    old = _old_gpus(driver)
    if version_tuple(version) < version_tuple(min_driver):
        gpu_hint = f" This box has {', '.join(old)}: use branch 535 .. {DRIVER_BRANCH_MAX_OLD_GPUS}." if old else ""
        return (f"NVIDIA driver {version} is too old for CUDA {release}, which needs >= {min_driver}. "
                f"Upgrade the driver: {branch_hint}.{gpu_hint}")
    branch = version_tuple(version)[0]
    if old and branch > DRIVER_BRANCH_MAX_OLD_GPUS:
        return (f"NVIDIA driver {version} (branch {branch}) does not support {', '.join(old)}: Pascal and "
                f"Volta GPUs need branch {DRIVER_BRANCH_MAX_OLD_GPUS} or older. Install e.g. branch 535 or 580.")
    return None


def check_prefix(prefix: str) -> str | None:
    if prefix.rstrip("/") in SYSTEM_DIRS or prefix.rstrip("/") == CUDA_LINK:
        return (f"cuda_prefix {prefix!r} is a system folder or the /usr/local/cuda link itself; "
                "set cuda_prefix to a folder of its own such as /usr/local/cuda-11.8")
    return None


def disk_needs(want: CudaWant, cached: frozenset = frozenset()) -> list[tuple[str, int, str]]:
    """(path, MiB, what for) that an install needs."""
    needs = [
        (want.tmpdir, TMPDIR_NEED_MIB, "for the runfile to unpack"),
        (want.prefix, PREFIX_NEED_MIB, "for the toolkit and cuDNN"),
    ]
    cache = sum(mib for name, mib in ((RUNFILE, want.runfile_mib), (CUDNN, want.cudnn_mib)) if name not in cached)
    if cache:
        needs.append((want.box_cache, cache, "for the runfile and cuDNN archive"))
    return needs


def check_disk(want: CudaWant, disk: Mapping[str, Mapping | None], cached: frozenset = frozenset()) -> str | None:
    by_fs: dict[tuple, list[tuple[str, int, str]]] = {}
    free: dict[tuple, int] = {}
    for path, mib, why in disk_needs(want, cached):
        measured = disk.get(path)
        if not measured:
            return f"could not measure free disk for {path} (df printed nothing usable)"
        key = (measured.get("filesystem"), measured.get("mount"))
        by_fs.setdefault(key, []).append((path, mib, why))
        free[key] = int(measured["free_mib"])
    for key, items in by_fs.items():
        need = sum(mib for _, mib, _ in items)
        if free[key] < need:
            parts = "; ".join(f"{path}: {mib} MiB {why}" for path, mib, why in items)
            return (f"not enough free disk on {key[1]} ({key[0]}): {free[key]} MiB free, {need} MiB needed "
                    f"({parts}). Free some space, or point install_tmpdir / cuda_prefix / lab_root at a "
                    "filesystem with room.")
    return None


# ---------------------------------------------------------------- the plan (pure)


def marker_matches(want: CudaWant, marker: Mapping[str, str] | None) -> bool:
    return bool(marker) and (
        marker.get("prefix") == want.prefix
        and marker.get("cuda_version") == want.cuda_version
        and marker.get("cudnn_version") == want.cudnn_version
    )


def toolkit_proven(want: CudaWant, toolkits: Mapping) -> bool:
    """The CudaToolkits fact shows nvcc and cuDNN of the wanted releases at the prefix."""
    tk = (toolkits.get("toolkits") or {}).get(want.prefix)
    nvcc = (tk or {}).get("nvcc") or {}
    return bool(tk) and nvcc.get("release") == want.cuda_release and tk.get("cudnn") == want.cudnn_header


def installed(want: CudaWant, toolkits: Mapping, marker: Mapping[str, str] | None) -> bool:
    """Proven toolkit, no install in progress, and the stage's marker for it: nothing to do."""
    tk = (toolkits.get("toolkits") or {}).get(want.prefix) or {}
    return toolkit_proven(want, toolkits) and not tk.get("in_progress") and marker_matches(want, marker)


def plan_cuda(want: CudaWant, facts: CudaFacts) -> CudaPlan:
    problems = [p for p in (
        check_distro(facts.os_release),
        None if facts.driver_stage else check_driver(facts.driver, want.min_driver, want.allow_no_driver,
                                                     want.cuda_release),
        check_prefix(want.prefix),
    ) if p]

    common = dict(host_cc=facts.compiler.cc, host_cxx=facts.compiler.cxx)

    tk = (facts.toolkits.get("toolkits") or {}).get(want.prefix)
    nvcc = (tk or {}).get("nvcc") or {}
    proven = toolkit_proven(want, facts.toolkits)
    action, reason, wipe = "install", f"nothing at {want.prefix} yet", False
    if tk and tk.get("in_progress"):
        reason, wipe = f"an interrupted install was found at {want.prefix}; it is removed and redone", True
    elif installed(want, facts.toolkits, facts.marker):
        action, reason = "done", f"CUDA {want.cuda_version} and cuDNN {want.cudnn_version} at {want.prefix}, proven"
    elif proven:
        action, reason = "adopt", (f"{want.prefix} already holds nvcc {nvcc.get('version')} and cuDNN "
                                   f"{tk.get('cudnn')}; proving it and writing the marker")
    elif nvcc and nvcc.get("release") != want.cuda_release:
        problems.append(f"cuda_prefix {want.prefix} already holds CUDA {nvcc.get('release')} "
                        f"(nvcc {nvcc.get('version')}), not {want.cuda_release}: set cuda_prefix to another "
                        "folder, or remove that toolkit yourself")
    elif tk:
        reason = (f"{want.prefix} exists without a complete CUDA {want.cuda_release} + cuDNN "
                  f"{want.cudnn_header}; installing over it")

    if action == "install" and not problems:
        low = check_disk(want, facts.disk, facts.cached)
        if low:
            problems.append(low)
    if problems:
        return CudaPlan(action="refuse", reason="pre-checks failed", problems=tuple(problems), **common)
    fetch = (RUNFILE, CUDNN) if action == "install" else ()
    return CudaPlan(action=action, reason=reason, fetch=fetch, wipe_partial=wipe, **common)


def runfile_command(want: CudaWant) -> list[str]:
    """The runfile invocation, toolkit only, side by side."""
    return ["sh", want.runfile_path, "--silent", "--toolkit", f"--installpath={want.prefix}",
            *RUNFILE_FLAGS[2:], f"--tmpdir={want.workdir}/runfile"]


def script_values(want: CudaWant, plan: CudaPlan, *, cuda_link: str = CUDA_LINK,
                  installer_tmp_log: str = INSTALLER_TMP_LOG, installer_log: str = INSTALLER_LOG,
                  private_tmp: bool = True) -> dict:
    """The variables of files/templates/cuda-install.sh.j2 (``q`` holds shell-quoted ones). ``private_tmp``:
    the runfile with a /tmp of its own (``PRIVATE_TMP``); off only for a script whose files lie under /tmp
    (tests/unit/test_cuda_script.py's rig)."""
    mode = "install" if plan.action == "install" else "adopt"
    remove_after = [want.runfile_path, want.runfile_path + ".sha256",
                    want.cudnn_path, want.cudnn_path + ".sha256"] if plan.action == "install" else []
    q = {
        "prefix": want.prefix,
        "workdir": want.workdir,
        "cuda_link": cuda_link,
        "marker": want.marker,
        "mode": mode,
        "installer_log": installer_tmp_log,
        "runfile_log": installer_log,
        "cudnn_archive": want.cudnn_path,
        "cudnn_header": want.cudnn_header,
    }
    values = {key: shlex.quote(value) for key, value in q.items()}
    values["remove_after"] = [shlex.quote(p) for p in remove_after]
    return {
        "q": values,
        "in_progress_name": IN_PROGRESS,
        "cuda_version": want.cuda_version,
        "cuda_release": want.cuda_release,
        "cudnn_version": want.cudnn_version,
        "cudnn_header": want.cudnn_header,
        "cudnn_top": want.cudnn_top,
        "prefix": want.prefix,
        "runfile_log": installer_log,
        "runfile_command": shlex.join(runfile_command(want)),
        "run_runfile": shlex.join([*(PRIVATE_TMP if private_tmp else ()), *runfile_command(want)]),
        "write_marker": marker_command(want.marker, [
            ("stage", "cuda"), ("cuda_version", want.cuda_version), ("nvcc_version", OnBox("$nvcc_version")),
            ("cudnn_version", want.cudnn_version), ("cudnn_header", OnBox("$cudnn_found")),
            ("prefix", want.prefix), ("host_cc", plan.host_cc), ("host_cxx", plan.host_cxx),
            ("runfile_sha256", want.runfile_sha256 or "none"), ("cudnn_sha256", want.cudnn_sha256 or "none"),
            ("cuda_link", OnBox("$(link_state)")), ("how", mode),
            ("written", OnBox("$(date -u +%Y-%m-%dT%H:%M:%SZ)"))]),
    }


def refusal_text(host_name: str, problems: tuple[str, ...]) -> str:
    lines = [f"verl-lab cuda: {host_name}: nothing was changed by the CUDA stage:"]
    lines += [f"  - {p}" for p in problems]
    return "\n".join(lines)


# ---------------------------------------------------------------- pyinfra


def gather_facts(settings: LabSettings, want: CudaWant, gpu: HostTarget) -> CudaFacts:
    """The box's facts for plan_cuda, in one command (tasks/facts/bundle.py); the driver comes
    from the host's GPU fact, read once before the stages (tasks/target.py). Free disk and the
    cached archives matter only to an install: a box whose toolkit is installed and marked is
    not asked for them."""
    distro, toolkits, marker = ask(
        (LinuxDistribution, {}), (CudaToolkits, {"prefixes": [want.prefix]}), (Marker, {"path": want.marker}))
    driver = gpu.driver
    distro, toolkits = distro or {}, toolkits or {}
    cached, disk = set(), {}
    if not installed(want, toolkits, marker):
        for name, path, sha in ((RUNFILE, want.runfile_path, want.runfile_sha256),
                                (CUDNN, want.cudnn_path, want.cudnn_sha256)):
            stamp = host.get_fact(VerifiedArtifact, path=path)
            if stamp and stamp["sha256"] == (sha or "no-sha256"):
                cached.add(name)
        disk = {path: host.get_fact(FreeDisk, path=path) for path in (want.tmpdir, want.prefix, want.box_cache)}
    return CudaFacts(
        os_release=distro.get("release_meta") or {},
        driver=driver,
        toolkits=toolkits,
        disk=disk,
        compiler=gpu.compiler,
        marker=marker,
        cached=frozenset(cached),
        driver_stage=gpu.driver_stage,
    )


@deploy("CUDA 11.8 toolkit and cuDNN 8.9.7")
def install_cuda(settings: LabSettings, gpu: HostTarget):
    """Install CUDA 11.8 (toolkit only) and cuDNN 8.9.7 into settings.cuda_prefix, side by side."""
    want = cuda_want(settings)
    plan = plan_cuda(want, gather_facts(settings, want, gpu))

    if plan.action == "refuse":
        fail_host(name=f"CUDA {want.cuda_release} pre-checks failed (nothing changed)",
                  message=refusal_text(settings.host, plan.problems))
        return

    if plan.action == "done":
        host.noop(plan.reason)
        return

    for name in plan.fetch:
        artifact_file(name=f"Fetch {name} (verified)", settings=settings, artifact=name)

    script = f"{settings.box_cache}/cuda/install-cuda-{want.cuda_version}.sh"
    files.template(name="CUDA install script", src=str(TEMPLATE), dest=script,
                   mode="700", user="root", group="root", **script_values(want, plan))
    server.shell(name=f"CUDA {want.cuda_version} + cuDNN {want.cudnn_version} into {want.prefix}: {plan.reason}",
                 commands=[f"sh {shlex.quote(script)}"])
