"""Free page reporting on the bench VM, and the write size that helps under it (bench only).

The bench VM (Firecracker) has a virtio balloon that reports free memory to its host: every
free block of the reporting order (9: 2 MiB) is handed back, and the next use faults it in
again on the host. The kernel gives the page cache folios about the size of each write; folios
of up to 32 KiB (order 3) come from the per-CPU lists of recently freed pages, larger ones from
the high-order blocks that were reported. So on such a VM, writing each received block in
32 KiB pieces was faster; without reporting, whole blocks were (docs/benchmarks.md,
"Download"). Measured only on that VM, so the product's fetcher (tasks.fetch.download) writes
whole blocks; bench/download.py chooses the write size through its ``write_block`` argument
(``piece_writer``), and bench.harness reads and turns off the reporting with what is here.
Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import IO

SYS = Path("/sys")
PAGE_REPORTING_ORDER = "module/page_reporting/parameters/page_reporting_order"   # under SYS
MAX_BUDDY_ORDER = 10   # the largest free block order on x86-64: a reporting order above it reports nothing
# bench/download.py, 1 GiB over loopback on the bench VM, same runs: whole 256 KiB blocks
# 0.47-0.56x curl, 32 KiB pieces 0.63-0.83x; with reporting off, whole blocks 0.77-0.89x,
# 32 KiB pieces 0.73-0.80x.
WRITE_PIECE_REPORTING_VM = 32 * 1024


def page_reporting_order(sys_root: Path | None = None) -> int | None:
    """The order from which this kernel reports free blocks to its host (virtio balloon free
    page reporting), or None where the kernel has no page reporting."""
    try:
        return int(((sys_root or SYS) / PAGE_REPORTING_ORDER).read_text().strip())
    except (OSError, ValueError):
        return None


def free_pages_reported(sys_root: Path | None = None) -> bool:
    """True on a Linux VM whose free memory is being reported to its host: a virtio balloon
    device offering VIRTIO_BALLOON_F_REPORTING (feature bit 5) and a reporting order the buddy
    allocator can reach (a higher one, as bench.harness.free_page_reporting_off sets, stops
    reporting). Not detected: Hyper-V's balloon (WSL2), which reports through another driver."""
    root = sys_root or SYS
    order = page_reporting_order(root)
    if order is None or order > MAX_BUDDY_ORDER:
        return False
    for dev in (root / "bus/virtio/devices").glob("*"):
        try:
            if int((dev / "device").read_text().strip(), 16) == 5:
                bits = (dev / "features").read_text().strip()
                if len(bits) > 5 and bits[5] == "1":
                    return True
        except (OSError, ValueError):
            continue
    return False


def write_size(sys_root: Path | None = None) -> int | None:
    """The write size the bench VM's tuning picks: 32 KiB pieces where free pages are reported,
    each block whole (None) elsewhere."""
    return WRITE_PIECE_REPORTING_VM if free_pages_reported(sys_root) else None


def write_in_pieces(out: IO[bytes], block: bytes, piece: int | None) -> None:
    """``out.write(block)`` as writes of at most ``piece`` bytes (None: one write)."""
    if piece is None or len(block) <= piece:
        out.write(block)
        return
    view = memoryview(block)
    for start in range(0, len(view), piece):
        out.write(view[start:start + piece])


def piece_writer(piece: int | None) -> Callable[[IO[bytes], bytes], None] | None:
    """A ``write_block`` for tasks.fetch.download that writes each block in ``piece``-byte
    pieces (None: the fetcher's own whole-block write)."""
    if piece is None:
        return None
    return lambda out, block: write_in_pieces(out, block, piece)
