"""One builder at a time for a cache that test runs share: two runs on one machine, or the
pytest-xdist workers of one run (the README's test command runs several).

    with locked(cache / "wheels.lock"):
        if not stamp.is_file():        # look again: another process may have built it meanwhile
            build()

``flock`` is released by the kernel when its holder dies, so a crashed builder never blocks the
next one; what the builder left half done is the caller's to notice (a completion stamp written
last).
"""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def locked(lock_path: Path):
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
