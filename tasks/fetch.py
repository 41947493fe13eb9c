"""The artifact fetcher every stage uses.

Two halves:

* ``download`` runs on the controller: one HTTP(S) download into the controller cache with a
  tqdm progress bar, resuming a partial ``.part`` file, a bounded retry, and a size then sha256
  check. A wrong file is deleted and reported with the expected and actual sha256; a mirror that
  answers an HTML page is reported as such. A lock file keeps two hosts' deploys from fetching
  the same artifact at once, so with N boxes each artifact is fetched once.
* ``artifact_file`` is a pyinfra operation that puts a verified artifact at a path on the box:
  in ``relay`` mode it uploads the controller's verified copy, in ``direct`` mode the box
  downloads it with curl (resuming). Either way the box checks sha256 before the file gets its
  final name, and records the verified checksum beside it, so a re-run is a no-op.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import requests
from tqdm import tqdm

CHUNK = 1 << 20
# Bytes per read from the socket: large enough that Python's per-block cost stays small next
# to the transfer (bench/download.py), small enough that a cut connection loses little of what
# was received (the part file holds every whole block; the resume asks for the rest).
READ_CHUNK = 256 * 1024
RETRIES = 3
TIMEOUT = (15, 60)  # connect, read (a stalled mirror fails within a minute)
WriteBlock = Callable[[IO[bytes], bytes], object]   # (part file, received block)


class FetchError(RuntimeError):
    """A download failed for good; the message names the URL and what went wrong."""


class ChecksumMismatch(FetchError):
    def __init__(self, url: str, path: Path, expected: str, actual: str):
        self.expected, self.actual = expected, actual
        super().__init__(
            f"sha256 mismatch for {url}: expected {expected}, got {actual}. "
            f"The file was deleted ({path}); it was not installed. If the mirror serves a "
            f"different build, fix mirror_urls or the catalog entry."
        )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Expected:
    sha256: str | None
    size: int | None


def _check(url: str, path: Path, want: Expected, actual: str | None = None) -> None:
    """Size, then sha256 (``actual``: the digest computed while downloading, if any)."""
    size = path.stat().st_size
    if want.size is not None and size != want.size:
        path.unlink()
        raise FetchError(
            f"size mismatch for {url}: expected {want.size} bytes, got {size}. "
            f"The file was deleted ({path}); the next run downloads it again."
        )
    if want.sha256:
        actual = actual or sha256_of(path)
        if actual != want.sha256:
            path.unlink()
            raise ChecksumMismatch(url, path, want.sha256, actual)


# pyinfra prepares hosts concurrently in one process (gevent greenlets). flock() is per open
# file: a second greenlet asking for the lock of a file the first one holds blocks the whole
# process, and the first can never finish. So greenlets/threads queue on an in-process lock
# per path first (gevent makes threading.Lock cooperative), and flock only guards against
# other processes (two deploys on one controller).
_PATH_LOCKS: dict[str, threading.Lock] = {}
_PATH_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def locked(path: Path):
    """Hold ``path``.lock against other greenlets/threads of this process and other processes."""
    lock_path = path.with_name(path.name + ".lock")
    with _PATH_LOCKS_GUARD:
        in_process = _PATH_LOCKS.setdefault(str(lock_path), threading.Lock())
    with in_process, open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _verified_stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def download(url: str, dest: Path, want: Expected, *, session: requests.Session | None = None,
             progress: bool | None = None, sleep: Callable[[float], None] = time.sleep,
             timeout: tuple[float, float] = TIMEOUT, write_block: WriteBlock | None = None) -> Path:
    """Download ``url`` to ``dest`` on the controller, verified. Returns ``dest``.

    A verified ``dest`` (its stamp matches) is returned without any network access.
    ``write_block(out, block)``: how each received block goes into the part file (default: one
    ``out.write(block)``); the download bench passes other write sizes through it.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    stamp = _verified_stamp(dest)
    with locked(dest):
        if dest.is_file() and stamp.is_file() and stamp.read_text().strip() == _stamp_text(dest, want):
            if dest.stat().st_mtime_ns <= stamp.stat().st_mtime_ns:
                return dest
            # written to after it was verified (same size): trusted only if it still checks out
            if not want.sha256 or sha256_of(dest) == want.sha256:
                stamp.write_text(_stamp_text(dest, want) + "\n")
                return dest
            dest.unlink()
            stamp.unlink()
        part = dest.with_name(dest.name + ".part")
        http = session or requests.Session()
        last_error: Exception | None = None
        digest = None
        for attempt in range(1, RETRIES + 1):
            try:
                digest = _download_once(http, url, part, want, progress, timeout, write_block)
                break
            except FetchError:
                raise
            except (requests.RequestException, OSError) as exc:
                last_error = exc
                if attempt < RETRIES:
                    sleep(2 ** attempt)
        else:
            raise FetchError(
                f"download of {url} failed after {RETRIES} tries: {last_error}. "
                f"The partial file {part} is kept and resumed on the next run."
            )
        _check(url, part, want, digest)
        os.replace(part, dest)
        stamp.write_text(_stamp_text(dest, want) + "\n")
        return dest


def _stamp_text(path: Path, want: Expected) -> str:
    size = path.stat().st_size if path.exists() else -1
    return f"{want.sha256 or 'no-sha256'} {size}"


def _download_once(http: requests.Session, url: str, part: Path, want: Expected, progress: bool | None,
                   timeout: tuple[float, float], write_block: WriteBlock | None = None) -> str | None:
    """Append the rest of ``url`` to ``part``; return the sha256 of the whole part file, hashed
    while writing (one pass over the bytes, not a second read), or None when nothing was sent."""
    have = part.stat().st_size if part.exists() else 0
    if want.size is not None and have > want.size:
        part.unlink()
        have = 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    with http.get(url, stream=True, headers=headers, timeout=timeout, allow_redirects=True) as resp:
        if resp.status_code == 416 and have:
            # Range not satisfiable: the part file is already complete (or wrong); check it.
            return None
        if resp.status_code >= 500:
            raise requests.HTTPError(f"{url} answered HTTP {resp.status_code}")
        if resp.status_code >= 400:
            raise FetchError(f"{url} answered HTTP {resp.status_code}: check mirror_urls / mirror_profile")
        ctype = resp.headers.get("Content-Type", "")
        if "text/html" in ctype and not url.endswith((".html", ".htm")):
            raise FetchError(
                f"{url} answered an HTML page (Content-Type {ctype!r}), not the file: the mirror "
                "is probably showing a login, error or captcha page. Check the URL in a browser."
            )
        mode = "ab"
        if have and resp.status_code != 206:
            mode, have = "wb", 0  # server ignored Range: start over
        digest = hashlib.sha256()
        if have:  # resuming: the bytes already on disk are part of the file's hash
            with open(part, "rb") as done:
                for block in iter(lambda: done.read(CHUNK), b""):
                    digest.update(block)
        total = resp.headers.get("Content-Length")
        total_bytes = (int(total) + have) if total and total.isdigit() else want.size
        show = sys.stderr.isatty() if progress is None else progress
        with open(part, mode) as out, tqdm(
            total=total_bytes, initial=have, unit="B", unit_scale=True, unit_divisor=1024,
            desc=part.name.removesuffix(".part"), disable=not show, leave=False,
        ) as bar:
            for block in resp.iter_content(READ_CHUNK):
                if write_block is None:
                    out.write(block)
                else:
                    write_block(out, block)
                digest.update(block)
                bar.update(len(block))
        if total and total.isdigit() and part.stat().st_size != int(total) + have:
            raise requests.ConnectionError(f"{url}: connection closed early")
        return digest.hexdigest()


def box_fetch_script(url: str, dest: str, sha256: str | None, size: int | None) -> str:
    """The shell run on a box in direct mode: resume into dest.part, check, then rename."""
    q = shlex.quote
    part = dest + ".part"
    lines = [
        "set -e",
        f"mkdir -p {q(os.path.dirname(dest))}",
        f"ctype=$(curl -fL --retry 3 --retry-delay 2 --connect-timeout 15 --speed-limit 1024 --speed-time 60 "
        f"-w '%{{content_type}}' -C - -o {q(part)} {q(url)}) || "
        f"{{ echo 'download failed: {url} (partial file kept for resume)' >&2; exit 1; }}",
        f"case \"$ctype\" in text/html*) rm -f {q(part)}; echo \"{url} answered an HTML page "
        f"(Content-Type $ctype), not the file: the mirror is probably showing a login, error or captcha "
        f"page; deleted\" >&2; exit 1;; esac",
    ]
    if size is not None:
        lines.append(
            f"got=$(stat -c %s {q(part)}); if [ \"$got\" != {size} ]; then rm -f {q(part)}; "
            f"echo \"size mismatch for {url}: expected {size}, got $got; deleted\" >&2; exit 1; fi"
        )
    lines += _verify_and_stamp(part, dest, sha256, url)
    return "\n".join(lines)


def _verify_and_stamp(src: str, dest: str, sha256: str | None, what: str) -> list[str]:
    q = shlex.quote
    lines = []
    if sha256:
        lines.append(
            f"got=$(sha256sum {q(src)} | cut -d' ' -f1); if [ \"$got\" != {sha256} ]; then rm -f {q(src)}; "
            f"echo \"sha256 mismatch for {what}: expected {sha256}, got $got; deleted, not installed\" >&2; exit 1; fi"
        )
    lines += [
        f"mv -f {q(src)} {q(dest)}",
        f"echo \"{sha256 or 'no-sha256'} $(stat -c %s {q(dest)})\" > {q(dest + '.sha256')}",
    ]
    return lines


def box_verify_script(src: str, dest: str, sha256: str | None, what: str) -> str:
    return "\n".join(["set -e", *_verify_and_stamp(src, dest, sha256, what)])
