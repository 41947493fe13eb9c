"""The GPUs of a box: what nvidia-smi (or NVML, inside the training env) says they are.

One call answers for every GPU:

    nvidia-smi --query-gpu=index,name,compute_cap,memory.total,memory.free,driver_version \
        --format=csv,noheader,nounits

Drivers older than about 510 do not know the ``compute_cap`` field; then the query runs again
without it and the compute capability comes from the GPU's name (``GPU_NAME_TABLE``: NVIDIA's
published compute capability of each card), and the inventory says so in ``notes``.

A box without nvidia-smi, without a loaded driver, or without GPUs is an answer too
(``GpuInventory(gpus=(), problem="...")``), never an exception: a stage decides what to do
with a GPU-less box, per host. The same command also reads the driver where the query fails
(plain ``nvidia-smi``'s banner, then ``/proc/driver/nvidia/version``), so one fact answers both
"which GPUs" (the plan, the env) and "which driver" (the CUDA stage's pre-check): ``driver_view``.

Standard library only (NVML's ``pynvml`` is imported inside ``read_nvml``, which runs in the
training env): the pyinfra fact class ``tasks.facts.gpu.NvidiaGpus`` runs ``fact_command()`` on
the box and ``parse_fact_output`` on the controller, and the training stage ships this file
unchanged beside the launcher (``<train_dir>/verl_lab_gpu.py``) for the preflight's nvidia-smi
and NVML readings.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

QUERY_FIELDS = ("index", "name", "compute_cap", "memory.total", "memory.free", "driver_version")
QUERY_FIELDS_OLD_DRIVER = ("index", "name", "memory.total", "memory.free", "driver_version")


def query_command(fields: tuple[str, ...] = QUERY_FIELDS) -> str:
    return f"nvidia-smi --query-gpu={','.join(fields)} --format=csv,noheader,nounits"


# Name patterns -> compute capability, for drivers whose nvidia-smi lacks compute_cap.
# Checked in order: the first pattern found in the lowercased name wins.
GPU_NAME_TABLE: tuple[tuple[str, str], ...] = (
    ("h200", "9.0"),
    ("h100", "9.0"),
    ("gh200", "9.0"),
    ("l40s", "8.9"),
    ("l40", "8.9"),
    ("l4", "8.9"),
    ("rtx 4090", "8.9"),
    ("rtx 4080", "8.9"),
    ("rtx 6000 ada", "8.9"),
    ("a100", "8.0"),
    ("a30", "8.0"),
    ("a800", "8.0"),
    ("rtx 3090", "8.6"),
    ("rtx 3080", "8.6"),
    ("rtx a6000", "8.6"),
    ("a40", "8.6"),
    ("a10", "8.6"),
    ("rtx 2080", "7.5"),
    ("titan rtx", "7.5"),
    ("quadro rtx", "7.5"),
    ("t4", "7.5"),
    ("v100", "7.0"),
    ("titan v", "7.0"),
    ("p100", "6.0"),
    ("p40", "6.1"),
    ("p4", "6.1"),
    ("gtx 1080", "6.1"),
    # GPUs the pinned stack refuses (tasks/gpu_support.py); their old drivers' nvidia-smi lacks compute_cap
    ("m40", "5.2"),
    ("m60", "5.2"),
    ("k80", "3.7"),
    ("k40m", "3.5"),
    ("k40c", "3.5"),
    ("k20m", "3.5"),
    ("k20x", "3.5"),
    ("b200", "10.0"),
    ("rtx 5090", "12.0"),
)

# What nvidia-smi prints when something is wrong, mapped to a short cause.
_FAILURES = (
    ("couldn't communicate with the nvidia driver", "the NVIDIA driver is not loaded (nvidia-smi cannot talk to it)"),
    ("driver/library version mismatch", "the loaded NVIDIA kernel module and the user-space driver differ (reboot or reload the module)"),
    ("no devices were found", "the driver sees no NVIDIA GPU"),
)

_NA = {"[n/a]", "n/a", "[not supported]", "[unknown error]", ""}


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    compute_capability: str | None      # "8.6"; None if neither nvidia-smi nor the name table knows
    memory_total_mib: int
    memory_free_mib: int | None
    driver_version: str
    compute_capability_from: str = "nvidia-smi"   # nvidia-smi | nvml | name table | unknown

    @property
    def cc(self) -> tuple[int, int] | None:
        return parse_compute_capability(self.compute_capability) if self.compute_capability else None


@dataclass(frozen=True)
class GpuInventory:
    gpus: tuple[Gpu, ...] = ()
    problem: str | None = None          # why there is no usable GPU list (None when gpus is the answer)
    notes: tuple[str, ...] = field(default_factory=tuple)
    source: str = "nvidia-smi"
    # the driver where the GPU query failed: from nvidia-smi's banner or /proc/driver/nvidia/version
    fallback_driver: str | None = None
    fallback_driver_from: str | None = None     # "nvidia-smi" | "proc"
    has_smi: bool = True                         # nvidia-smi is installed

    @property
    def ok(self) -> bool:
        return self.problem is None and bool(self.gpus)

    @property
    def driver_version(self) -> str | None:
        return self.gpus[0].driver_version if self.gpus else None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> GpuInventory:
        return cls(
            gpus=tuple(Gpu(**g) for g in data.get("gpus", ())),
            problem=data.get("problem"),
            notes=tuple(data.get("notes", ())),
            source=data.get("source", "nvidia-smi"),
            fallback_driver=data.get("fallback_driver"),
            fallback_driver_from=data.get("fallback_driver_from"),
            has_smi=data.get("has_smi", True),
        )


def driver_view(inv: GpuInventory) -> dict | None:
    """The box's NVIDIA driver as the CUDA stage's pre-check reads it; None when the box shows no
    sign of a driver (no nvidia-smi and no /proc/driver/nvidia/version)::

        {"version": "535.104.05" or None, "source": "nvidia-smi" | "proc",
         "gpus": [{"driver": ..., "name": "Tesla P40", "compute_cap": "6.1" or None}],
         "error": None or why nvidia-smi gave no GPU list}
    """
    if inv.gpus:
        return {"version": inv.gpus[0].driver_version, "source": "nvidia-smi", "error": None,
                "gpus": [{"driver": g.driver_version, "name": g.name, "compute_cap": g.compute_capability}
                         for g in inv.gpus]}
    if inv.fallback_driver:
        return {"version": inv.fallback_driver, "source": inv.fallback_driver_from or "proc", "gpus": [],
                "error": None}
    if not inv.has_smi:
        return None
    return {"version": None, "source": "nvidia-smi", "gpus": [], "error": inv.problem or "nvidia-smi listed no GPU"}


def parse_compute_capability(text: str) -> tuple[int, int]:
    """ "8.6" -> (8, 6). Raises ValueError on anything else."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(text))
    if not m:
        raise ValueError(f"{text!r} is not a compute capability such as 8.6")
    return int(m.group(1)), int(m.group(2))


def compute_capability_from_name(name: str) -> str | None:
    low = " ".join(name.lower().replace("-", " ").split())
    for pattern, cc in GPU_NAME_TABLE:
        if re.search(r"(^|\s)" + re.escape(pattern) + r"(\s|$)", low):
            return cc
    return None


def _failure_cause(text: str) -> str | None:
    low = text.lower()
    for needle, cause in _FAILURES:
        if needle in low:
            return cause
    return None


def _mib(value: str) -> int | None:
    v = value.strip()
    if v.lower() in _NA:
        return None
    v = re.sub(r"\s*mib$", "", v, flags=re.I)
    return int(float(v))


def parse_gpu_query(text: str, fields: tuple[str, ...] = QUERY_FIELDS) -> GpuInventory:
    """Parse the csv,noheader,nounits answer of ``query_command(fields)``.

    Also accepts the output with a header line or with units (`143771 MiB`), so a capture
    made with plain `--format=csv` parses the same.
    """
    cause = _failure_cause(text)
    if cause:
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        return GpuInventory(problem=f"{cause}: nvidia-smi said {first!r}")
    gpus: list[Gpu] = []
    notes: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.lower().startswith("index"):
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(fields):
            return GpuInventory(problem=f"nvidia-smi printed a line with {len(parts)} fields, expected "
                                        f"{len(fields)} ({', '.join(fields)}): {line!r}")
        row = dict(zip(fields, parts))
        try:
            index = int(row["index"])
            total = _mib(row["memory.total"])
            free = _mib(row["memory.free"]) if "memory.free" in row else None
        except ValueError:
            return GpuInventory(problem=f"nvidia-smi printed a line that is not a GPU record: {line!r}")
        if total is None:
            return GpuInventory(problem=f"nvidia-smi reports no memory size for GPU {index} ({row['name']})")
        cc = row.get("compute_cap")
        source = "nvidia-smi"
        if cc is not None and cc.lower() in _NA:
            cc = None
        if cc is None:
            cc = compute_capability_from_name(row["name"])
            source = "name table" if cc else "unknown"
            if cc:
                notes.append(f"GPU {index} ({row['name']}): compute capability {cc} taken from the name table "
                             "(this nvidia-smi does not report compute_cap)")
            else:
                notes.append(f"GPU {index} ({row['name']}): compute capability unknown (nvidia-smi does not "
                             "report it and the name is not in the table); set gpu_override in host data")
        else:
            parse_compute_capability(cc)
        gpus.append(Gpu(index=index, name=row["name"], compute_capability=cc, memory_total_mib=total,
                        memory_free_mib=free, driver_version=row["driver_version"],
                        compute_capability_from=source))
    if not gpus:
        return GpuInventory(problem="nvidia-smi listed no GPU")
    return GpuInventory(gpus=tuple(gpus), notes=tuple(notes))


# The fact's shell command prints tagged sections; always exits 0 so a GPU-less box answers.
NO_SMI = "__verl_lab_no_nvidia_smi__"
OLD_DRIVER = "__verl_lab_no_compute_cap__"
RC_TAG = "__verl_lab_rc__="
BANNER_TAG = "__verl_lab_smi_banner__"
PROC_TAG = "__verl_lab_proc_driver__"
_PROC_RE = re.compile(r"NVRM version:.*?Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)")
_SMI_BANNER_RE = re.compile(r"Driver Version:\s+(\d+\.\d+(?:\.\d+)?)")


def parse_smi_banner(text: str) -> str | None:
    """The driver version from plain ``nvidia-smi``'s banner (``Driver Version: 580.159.04``)."""
    match = _SMI_BANNER_RE.search(text or "")
    return match.group(1) if match else None


def parse_proc_driver_version(text: str) -> str | None:
    """The driver version from ``/proc/driver/nvidia/version`` (proprietary or open module)."""
    match = _PROC_RE.search(text or "")
    return match.group(1) if match else None


def fact_command() -> str:
    new, old = query_command(QUERY_FIELDS), query_command(QUERY_FIELDS_OLD_DRIVER)
    return (
        f"if command -v nvidia-smi >/dev/null 2>&1; then "
        f"out=$({new} 2>&1); rc=$?; "
        f"if [ $rc -ne 0 ] && printf '%s' \"$out\" | grep -qi 'compute_cap'; then "
        f"echo {OLD_DRIVER}; out=$({old} 2>&1); rc=$?; fi; "
        f"printf '%s\\n' \"$out\"; echo {RC_TAG}$rc; "
        f"if [ $rc -ne 0 ]; then echo {BANNER_TAG}; nvidia-smi 2>&1 | head -n 5; fi; "
        f"else echo {NO_SMI}; fi; "
        f"echo {PROC_TAG}; cat /proc/driver/nvidia/version 2>/dev/null; true"
    )


def parse_fact_output(text: str) -> GpuInventory:
    """Parse what ``fact_command()`` printed."""
    lines = text.splitlines()
    section, body, banner, proc = "query", [], [], []
    rc, old_driver, has_smi = 0, False, True
    for line in lines:
        s = line.strip()
        if s == NO_SMI:
            has_smi = False
        elif s == OLD_DRIVER:
            old_driver = True
        elif s.startswith(RC_TAG) and section == "query":
            rc = int(s[len(RC_TAG):] or 1)
        elif s == BANNER_TAG:
            section = "banner"
        elif s == PROC_TAG:
            section = "proc"
        else:
            {"query": body, "banner": banner, "proc": proc}[section].append(line)
    fallback = parse_smi_banner("\n".join(banner))
    fallback_from = "nvidia-smi" if fallback else None
    if not fallback:
        fallback = parse_proc_driver_version("\n".join(proc))
        fallback_from = "proc" if fallback else None
    driver = {"fallback_driver": fallback, "fallback_driver_from": fallback_from, "has_smi": has_smi}
    if not has_smi:
        return GpuInventory(problem="nvidia-smi is not installed (no NVIDIA driver on this box)", **driver)
    joined = "\n".join(body)
    fields = QUERY_FIELDS_OLD_DRIVER if old_driver else QUERY_FIELDS
    if rc != 0:
        cause = _failure_cause(joined)
        first = next((b.strip() for b in body if b.strip()), "(no output)")
        why = cause or "nvidia-smi failed"
        return GpuInventory(problem=f"{why}: nvidia-smi exited {rc} and said {first!r}", **driver)
    inv = parse_gpu_query(joined, fields)
    notes = inv.notes
    if old_driver and inv.ok:
        notes = ("this driver's nvidia-smi has no compute_cap field (driver older than ~510)",) + notes
    return GpuInventory(gpus=inv.gpus, problem=inv.problem, source=inv.source, notes=notes, **driver)


def read_nvml() -> GpuInventory:
    """Read the GPUs through NVML (package nvidia-ml-py, imported as pynvml).

    For use inside the training env (the launcher's preflight). Any failure is an answer.
    """
    try:
        import pynvml  # type: ignore
    except ImportError:
        return GpuInventory(problem="NVML is not available: nvidia-ml-py is not installed in this Python",
                            source="nvml")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError and friends (e.g. libnvidia-ml.so missing)
        return GpuInventory(problem=f"NVML could not start ({exc}): no NVIDIA driver is usable", source="nvml")
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(Gpu(index=i, name=name, compute_capability=f"{major}.{minor}",
                            memory_total_mib=round(int(mem.total) / (1024 * 1024)),   # rounded like nvidia-smi
                            memory_free_mib=round(int(mem.free) / (1024 * 1024)),
                            driver_version=driver, compute_capability_from="nvml"))
    except Exception as exc:
        return GpuInventory(problem=f"NVML failed while reading the GPUs: {exc}", source="nvml")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    if not gpus:
        return GpuInventory(problem="NVML lists no GPU", source="nvml")
    return GpuInventory(gpus=tuple(gpus), source="nvml")


# ---- what is held on the GPUs before training starts (the launcher's preflight) --------------
# memory.used + memory.free is the total CUDA (and vLLM) counts: drivers that report
# memory.reserved apart leave it out of both (verl_lab_box/vllm_share.py).
MEMORY_FIELDS = ("index", "memory.total", "memory.used", "memory.free")
# plain nvidia-smi's process table: both compute (C) and graphics (G) processes, which
# --query-compute-apps leaves out (a display server's Xorg and gnome-shell are G). Rows look like
#   |    0   N/A  N/A            1634      G   /usr/lib/xorg/Xorg                        590MiB |
# (GPU, GI, CI, PID, type, name, memory; drivers before MIG have no GI/CI columns).
_PROCESS_ROW = re.compile(r"^\|\s+(\d+)\s+(?:\S+\s+\S+\s+)?(\d+)\s+(C\+G|C|G)\s+(.+?)\s+(?:(\d+)MiB|N/A)\s*\|$")


@dataclass(frozen=True)
class GpuMemory:
    index: int
    total_mib: int
    used_mib: int
    free_mib: int

    @property
    def cuda_total_mib(self) -> int:
        return self.used_mib + self.free_mib


@dataclass(frozen=True)
class GpuProcess:
    gpu: int
    pid: int
    kind: str                    # "C" compute, "G" graphics, "C+G"
    name: str
    used_mib: int | None         # None: the driver does not say (N/A)


def memory_command() -> str:
    return query_command(MEMORY_FIELDS)


def parse_memory(text: str) -> list[GpuMemory]:
    """``memory_command()``'s answer; ValueError on anything else (a failing nvidia-smi)."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if not line.strip() or parts[0].lower() == "index":
            continue
        if len(parts) != len(MEMORY_FIELDS):
            raise ValueError(f"nvidia-smi printed {line.strip()!r}, not {', '.join(MEMORY_FIELDS)}")
        index, total, used, free = (int(p) for p in parts)
        out.append(GpuMemory(index, total, used, free))
    return out


def parse_processes(text: str) -> list[GpuProcess]:
    """The processes plain ``nvidia-smi`` lists under "Processes:" (empty when it lists none)."""
    found = []
    for line in text.splitlines():
        m = _PROCESS_ROW.match(line.rstrip())
        if m:
            gpu, pid, kind, name, mib = m.groups()
            found.append(GpuProcess(int(gpu), int(pid), kind, name.strip(), int(mib) if mib else None))
    return found
