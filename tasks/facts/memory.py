"""Facts about a box's memory (host RAM, not the GPU's)."""

from __future__ import annotations

from pyinfra.api import FactBase

KIB_PER_MIB = 1024


class HostMemory(FactBase[dict | None]):
    """The box's RAM from /proc/meminfo, in MiB: ``{"total_mib": MemTotal, "available_mib": MemAvailable}`` (what
    the kernel says a new process can have without swapping); None (the default) where it cannot be read.
    In a container, /proc/meminfo is the host's unless the container's runtime says otherwise."""

    def command(self) -> str:
        return "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo 2>&1; true"

    def process(self, output) -> dict | None:
        found = {}
        for line in output:
            key, _, value = line.partition(":")
            cells = value.split()
            if key in ("MemTotal", "MemAvailable") and cells and cells[0].isdigit():
                found[key] = int(cells[0]) // KIB_PER_MIB
        if "MemTotal" not in found:
            return self.default()
        return {"total_mib": found["MemTotal"], "available_mib": found.get("MemAvailable", found["MemTotal"])}
