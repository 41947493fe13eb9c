"""The GPUs a lab box can pretend to have, and the stand-in ``nvidia-smi`` that says so.

The table holds what the real ``nvidia-smi`` prints for each card (name, memory.total in MiB)
and its compute capability as NVIDIA publishes it. ``standin_nvidia_smi()`` renders a small Python
script that answers the queries the provisioner makes, in the real output formats (taken from a
real H200's nvidia-smi, tests/fixtures/nvidia-smi/h200.txt). It is a stand-in: there is no GPU in a box.
"""

from __future__ import annotations

import hashlib
import json
import uuid as uuidlib
from dataclasses import asdict, dataclass

DEFAULT_DRIVER = "535.104.05"   # branch 535: Pascal .. Hopper all supported


@dataclass(frozen=True)
class GpuModel:
    key: str              # short name used by tests and bin/lab: p40, t4, rtx3090 ...
    name: str             # exactly as nvidia-smi prints it
    compute_cap: str      # "6.1"
    memory_mib: int       # memory.total [MiB]
    power_cap_w: int
    reserved_mib: int     # memory.total - memory.free on an idle card
    datacenter: bool = True
    mig: bool = False

    @property
    def arch(self) -> str:
        major = int(self.compute_cap.split(".")[0])
        return {3: "kepler", 6: "pascal", 7: "volta" if self.compute_cap == "7.0" else "turing",
                8: "ampere" if self.compute_cap in ("8.0", "8.6") else "ada", 9: "hopper"}[major]


GPUS: dict[str, GpuModel] = {g.key: g for g in (
    # one GPU of a K80 board (nvidia-smi lists its two GPUs apart; reserved_mib not from a capture).
    # Kepler: its last driver branch is R470, CUDA 11.8 needs R520 (the driver stage refuses it)
    GpuModel("k80", "Tesla K80", "3.7", 11441, 149, 3),
    GpuModel("p40", "Tesla P40", "6.1", 24576, 250, 154),
    GpuModel("p100", "Tesla P100-PCIE-16GB", "6.0", 16384, 250, 104),
    GpuModel("v100", "Tesla V100-SXM2-32GB", "7.0", 32768, 300, 268),
    GpuModel("t4", "Tesla T4", "7.5", 15360, 70, 258),
    # 8 GB cards, the smallest the plan trains on (GRPO on CPU offload, docs/plan.md): names and
    # memory.total as nvidia-smi prints them; reserved_mib not from a capture
    GpuModel("gtx1080", "NVIDIA GeForce GTX 1080", "6.1", 8192, 180, 120, datacenter=False),
    GpuModel("rtx2070", "NVIDIA GeForce RTX 2070", "7.5", 8192, 175, 230, datacenter=False),
    GpuModel("rtx4060", "NVIDIA GeForce RTX 4060", "8.9", 8188, 115, 260, datacenter=False),
    GpuModel("rtx2080ti", "NVIDIA GeForce RTX 2080 Ti", "7.5", 11264, 250, 286, datacenter=False),
    GpuModel("rtx3090", "NVIDIA GeForce RTX 3090", "8.6", 24576, 350, 326, datacenter=False),
    GpuModel("rtx4090", "NVIDIA GeForce RTX 4090", "8.9", 24564, 450, 390, datacenter=False),
    GpuModel("a100", "NVIDIA A100-SXM4-80GB", "8.0", 81920, 400, 597, mig=True),
    GpuModel("h100", "NVIDIA H100 80GB HBM3", "9.0", 81559, 700, 594, mig=True),
    GpuModel("h200", "NVIDIA H200", "9.0", 143771, 700, 615, mig=True),
)}

# The CUDA version a driver branch reports in nvidia-smi's banner.
CUDA_OF_BRANCH = {450: "11.0", 460: "11.2", 470: "11.4", 510: "11.6", 515: "11.7", 520: "11.8",
                  525: "12.0", 530: "12.1", 535: "12.2", 545: "12.3", 550: "12.4", 555: "12.5",
                  560: "12.6", 565: "12.7", 570: "12.8", 575: "12.9", 580: "13.0"}


def cuda_of_driver(driver: str) -> str:
    branch = int(driver.split(".")[0])
    known = [b for b in sorted(CUDA_OF_BRANCH) if b <= branch]
    return CUDA_OF_BRANCH[known[-1]] if known else "11.0"


def gpu(key: str) -> GpuModel:
    try:
        return GPUS[key.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {key!r}; the lab knows: {', '.join(GPUS)}") from None


@dataclass(frozen=True)
class Card:
    """One GPU of one box, as nvidia-smi reports it."""

    model: GpuModel
    index: int
    uuid: str
    bus_id: str
    memory_used_mib: int = 0
    temp_c: int = 36
    power_w: int = 30


def cards_for(box_name: str, keys: list[str] | tuple[str, ...]) -> list[Card]:
    """Cards with stable, box-unique UUIDs and bus ids."""
    out = []
    for i, key in enumerate(keys):
        digest = hashlib.sha256(f"verl-lab-standin|{box_name}|{i}|{key}".encode()).digest()
        out.append(Card(model=gpu(key), index=i, uuid=f"GPU-{uuidlib.UUID(bytes=digest[:16])}",
                        bus_id=f"00000000:{0x3B + 0x1A * i:02X}:00.0"))
    return out


def standin_nvidia_smi(cards: list[Card], driver: str = DEFAULT_DRIVER,
                       clock: str | None = None) -> str:
    """The text of /usr/bin/nvidia-smi for a box with these cards.

    ``clock``: a fixed banner date (tests); None prints the box's current time.
    """
    data = {
        "driver": driver,
        "cuda": cuda_of_driver(driver),
        "clock": clock,
        "cards": [{**asdict(c), "model": asdict(c.model)} for c in cards],
    }
    return _SCRIPT.replace("@DATA@", json.dumps(data, indent=1, sort_keys=True))


_SCRIPT = r'''#!/usr/bin/python3
# STAND-IN nvidia-smi written by verl-lab's test harness (tests/lab/gpus.py).
# There is no GPU in this box: this script only answers the queries the provisioner makes,
# in the formats the real nvidia-smi prints. It says so nowhere but in this comment.
import json
import sys
import time

DATA = json.loads(r"""@DATA@""")

FIELDS = {
    # field (and aliases) -> (header, unit or None, value function)
    "index": ("index", None, lambda c: str(c["index"])),
    "name": ("name", None, lambda c: c["model"]["name"]),
    "gpu_name": ("name", None, lambda c: c["model"]["name"]),
    "compute_cap": ("compute_cap", None, lambda c: c["model"]["compute_cap"]),
    "memory.total": ("memory.total", "MiB", lambda c: str(c["model"]["memory_mib"])),
    "memory.used": ("memory.used", "MiB", lambda c: str(c["memory_used_mib"])),
    "memory.free": ("memory.free", "MiB", lambda c: str(c["model"]["memory_mib"] - c["model"]["reserved_mib"] - c["memory_used_mib"])),
    "driver_version": ("driver_version", None, lambda c: DATA["driver"]),
    "uuid": ("uuid", None, lambda c: c["uuid"]),
    "gpu_uuid": ("uuid", None, lambda c: c["uuid"]),
    "pci.bus_id": ("pci.bus_id", None, lambda c: c["bus_id"]),
    "gpu_bus_id": ("pci.bus_id", None, lambda c: c["bus_id"]),
    "count": ("count", None, lambda c: str(len(DATA["cards"]))),
    "temperature.gpu": ("temperature.gpu", None, lambda c: str(c["temp_c"])),
    "power.limit": ("power.limit", "W", lambda c: "%.2f" % c["model"]["power_cap_w"]),
}


def fail(msg, code=2):
    sys.stdout.write(msg + "\n\n")
    sys.exit(code)


def option(args, names):
    """Value of --opt=value / --opt value / -o value, or None."""
    for i, a in enumerate(args):
        for n in names:
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
            if a == n:
                if i + 1 >= len(args):
                    fail('Option "%s" requires a value.' % n)
                return args[i + 1]
    return None


def selected(args):
    ids = option(args, ("-i", "--id"))
    cards = DATA["cards"]
    if ids is None:
        return cards
    out = []
    for one in ids.split(","):
        hit = [c for c in cards if one.strip() in (str(c["index"]), c["uuid"], c["bus_id"])]
        if not hit:
            fail("No devices were found", 6)
        out += hit
    return out


def query(args):
    fields = [f.strip() for f in option(args, ("--query-gpu",)).split(",") if f.strip()]
    fmt = option(args, ("--format",))
    if fmt is None:
        fail('"--format" option must be specified with the "--query-*" options.')
    flags = [f.strip() for f in fmt.split(",")]
    if "csv" not in flags or any(f not in ("csv", "noheader", "nounits") for f in flags):
        fail('"%s" is not a valid format.' % fmt)
    for f in fields:
        if f not in FIELDS:
            fail('Field "%s" is not a valid field to query.' % f)
    cards = selected(args)
    lines = []
    if "noheader" not in flags:
        lines.append(", ".join(
            FIELDS[f][0] + (" [%s]" % FIELDS[f][1] if FIELDS[f][1] else "") for f in fields))
    for c in cards:
        vals = []
        for f in fields:
            v = FIELDS[f][2](c)
            if FIELDS[f][1] and "nounits" not in flags:
                v = "%s %s" % (v, FIELDS[f][1])
            vals.append(v)
        lines.append(", ".join(vals))
    sys.stdout.write("\n".join(lines) + "\n")


def list_gpus(args):
    for c in selected(args):
        print("GPU %d: %s (UUID: %s)" % (c["index"], c["model"]["name"], c["uuid"]))


def table(args):
    w = 89
    line = "+" + "-" * w + "+"
    sep = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"
    out = [DATA["clock"] or time.strftime("%a %b %e %H:%M:%S %Y"), line]
    out[0] = out[0].ljust(31)
    banner = " NVIDIA-SMI %-22s Driver Version: %-14s CUDA Version: %-8s" % (
        DATA["driver"], DATA["driver"], DATA["cuda"])
    out.append("|" + banner.ljust(w) + "|")
    out += [
        sep,
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|                                         |                        |               MIG M. |",
        "|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|",
    ]
    for n, c in enumerate(selected(args)):
        m = c["model"]
        persist = "On" if m["datacenter"] else "Off"
        fan = "N/A" if m["datacenter"] else "30%"
        ecc = "0" if m["datacenter"] else "N/A"
        mig = "Disabled" if m["mig"] else "N/A"
        out.append("|%4d  %-29s%4s  |%19s %3s |%21s |" % (c["index"], m["name"][:29], persist, c["bus_id"], "Off", ecc))
        out.append("|%4s%6s%6s%16s / %5s |%23s |%8s%13s |" % (
            fan, "%dC" % c["temp_c"], "P0" if n == 0 else "P8", "%dW" % c["power_w"], "%dW" % m["power_cap_w"],
            "%dMiB / %dMiB" % (c["memory_used_mib"], m["memory_mib"]), "0%", "Default"))
        out.append("|%41s|%24s|%21s |" % ("", "", mig))
        out.append(sep)
    out += [
        "",
        line,
        "| Processes:" + " " * 78 + "|",
        "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
        "|        ID   ID                                                               Usage      |",
        "|" + "=" * w + "|",
        "|  No running processes found" + " " * 61 + "|",
        line,
    ]
    sys.stdout.write("\n".join(out) + "\n")


def main(args):
    if not DATA["cards"]:
        fail("No devices were found", 6)
    if any(a == "--query-gpu" or a.startswith("--query-gpu=") for a in args):
        return query(args)
    if "-L" in args or "--list-gpus" in args:
        return list_gpus(args)
    if "--version" in args:
        print("NVIDIA-SMI version  : %s\nDRIVER version      : %s\nCUDA Version        : %s"
              % (DATA["driver"], DATA["driver"], DATA["cuda"]))
        return
    known = {"-i", "--id"}
    for a in args:
        if a.startswith("-") and a.split("=", 1)[0] not in known:
            fail("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
    return table(args)


main(sys.argv[1:])
'''
