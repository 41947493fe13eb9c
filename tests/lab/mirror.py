"""The lab's mirror: a threaded HTTP server on 127.0.0.1 that serves ``root`` the way the
real download hosts would (NVIDIA, the conda installer host, the git host, an HF endpoint),
at the URL paths the catalog uses, one folder per catalog source: ``<root>/<source>/<path>``.

What it does for tests:
- byte ranges (``Range: bytes=a-b`` -> 206 with ``Content-Range``), so resuming fetchers resume;
- correct ``Content-Length``, ``ETag``, ``Last-Modified``, ``Accept-Ranges: bytes``;
- counters: ``bytes_served`` (all bodies), ``bytes_by_path``, ``requests`` (a log);
- faults on a path prefix: ``mirror.fault = "500" | "404" | "html" | "stall" | "cut:<bytes>"
  | "slow:<bytes per second>"`` (a link of that speed)
  with ``mirror.fault_prefix`` (default "/") and ``mirror.fault_times`` (None = until cleared),
  or ``with mirror.faulty("cut:1000", prefix="/nvidia/", times=1): ...``;
- git over plain HTTP ("dumb" protocol): ``publish_git()`` makes a bare repo and runs
  ``git update-server-info`` so ``git clone http://127.0.0.1:PORT/github/x/y.git`` works;
- dynamic endpoints: ``add_route(prefix, handler)`` for API-shaped stand-ins (e.g. HF's API).

Run in a thread (``Mirror(root).start()``) in a test, or as a process for ``bin/lab up``:
``python -m tests.lab.mirror --root DIR [--port N] [--port-file F]``.
"""

from __future__ import annotations

import argparse
import email.utils
import html
import mimetypes
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# Sources of files/catalog.toml the lab serves: mirror_urls points each one at <url>/<source>.
# pypi stays the real index (reachable from these machines); pytorch is served so a test
# profile can stand the local CPU torch wheel in for the cu118 one.
LAB_SOURCES = ("nvidia", "pytorch", "miniforge", "conda", "github", "huggingface")

FAULTS = ("500", "404", "html", "stall", "cut:<bytes>", "slow:<bytes per second>")
CAPTIVE_PAGE = (b"<!DOCTYPE html><html><head><title>Sign in to the network</title></head>"
                b"<body><h1>Access denied</h1><p>Please log in to continue.</p></body></html>\n")


@dataclass
class Request:
    method: str
    path: str
    status: int
    range: str | None
    sent: int
    fault: str | None


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up early (pip probing, a cut download) is normal here, not a traceback."""

    def handle_error(self, request, client_address):
        import sys

        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


# A route handler gets (handler, path, query) and returns (status, headers, body) or None to
# fall through to the file tree.
Route = Callable[[BaseHTTPRequestHandler, str, dict], "tuple[int, dict, bytes] | None"]


class Mirror:
    def __init__(self, root: Path | str, host: str = "127.0.0.1", port: int = 0):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.host, self._port = host, port
        self.fault: str | None = None
        self.fault_prefix = "/"
        self.fault_times: int | None = None
        self.stall_s = 600.0
        self.bytes_served = 0
        self.bytes_by_path: dict[str, int] = {}
        self.requests: list[Request] = []
        self.routes: list[tuple[str, Route]] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Mirror:
        mirror = self

        class Handler(_Handler):
            pass

        Handler.mirror = mirror
        self._server = _QuietServer((self.host, self._port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="lab-mirror", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def port(self) -> int:
        assert self._server, "mirror not started"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, source: str) -> str:
        return f"{self.url}/{source}"

    @property
    def mirror_urls(self) -> dict[str, str]:
        return {s: self.url_for(s) for s in LAB_SOURCES}

    # ------------------------------------------------------------------ content
    def path(self, rel: str) -> Path:
        p = (self.root / rel.lstrip("/")).resolve()
        if not str(p).startswith(str(self.root.resolve())):
            raise ValueError(f"{rel!r} leaves the mirror root")
        return p

    def add_file(self, rel: str, content: bytes | str | Path) -> Path:
        """Serve ``content`` (bytes, text, or a file to copy) at ``/<rel>``."""
        dest = self.path(rel)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copyfile(content, dest)
        else:
            dest.write_bytes(content.encode() if isinstance(content, str) else content)
        return dest

    def publish_git(self, rel: str, work_tree: Path | str) -> str:
        """Serve the git repo at ``work_tree`` (all branches and tags) as ``/<rel>`` (dumb HTTP).

        Re-publishing replaces the served copy. Returns the clone URL.
        """
        dest = self.path(rel)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "clone", "-q", "--bare", "--no-local", str(work_tree), str(dest)], check=True)
        subprocess.run(["git", "-C", str(dest), "update-server-info"], check=True)
        return f"{self.url}/{rel.lstrip('/')}"

    def add_route(self, prefix: str, handler: Route) -> None:
        self.routes.append((prefix, handler))

    # ------------------------------------------------------------------ faults and counters
    @contextmanager
    def faulty(self, fault: str, prefix: str = "/", times: int | None = None):
        self.set_fault(fault, prefix, times)
        try:
            yield self
        finally:
            self.clear_fault()

    def set_fault(self, fault: str | None, prefix: str = "/", times: int | None = None) -> None:
        if fault is not None and not re.fullmatch(r"500|404|html|stall|cut:\d+|slow:\d+", fault):
            raise ValueError(f"unknown fault {fault!r}; use one of {', '.join(FAULTS)}")
        with self._lock:
            self.fault, self.fault_prefix, self.fault_times = fault, prefix, times

    def clear_fault(self) -> None:
        self.set_fault(None)

    def reset_counters(self) -> None:
        with self._lock:
            self.bytes_served = 0
            self.bytes_by_path = {}
            self.requests = []

    def served(self, path_prefix: str = "/") -> int:
        """Body bytes served for paths under ``path_prefix``."""
        with self._lock:
            return sum(n for p, n in self.bytes_by_path.items() if p.startswith(path_prefix))

    def _take_fault(self, path: str) -> str | None:
        with self._lock:
            if self.fault is None or not path.startswith(self.fault_prefix):
                return None
            fault = self.fault
            if self.fault_times is not None:
                self.fault_times -= 1
                if self.fault_times <= 0:
                    self.fault, self.fault_times = None, None
            return fault

    def _count(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def _add_bytes(self, path: str, n: int) -> None:
        # counted as each chunk is handed to the socket, so a client that has its bytes
        # always sees them counted
        with self._lock:
            self.bytes_served += n
            self.bytes_by_path[path] = self.bytes_by_path.get(path, 0) + n


class _Handler(BaseHTTPRequestHandler):
    mirror: Mirror
    protocol_version = "HTTP/1.1"
    server_version = "verl-lab-mirror/1"

    def log_message(self, fmt, *args):   # quiet; the mirror keeps its own request log
        pass

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)

    # ------------------------------------------------------------------
    def _serve(self, head: bool) -> None:
        m = self.mirror
        parsed = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(parsed.path)
        rng = self.headers.get("Range")
        fault = m._take_fault(path)
        if fault in ("500", "404"):
            return self._simple(int(fault), b"fault injected by the lab mirror\n", path, rng, fault, head)
        if fault == "html":
            return self._simple(200, CAPTIVE_PAGE, path, rng, fault, head, ctype="text/html; charset=utf-8")

        for prefix, route in m.routes:
            if path.startswith(prefix):
                answer = route(self, path, urllib.parse.parse_qs(parsed.query))
                if answer is not None:
                    status, headers, body = answer
                    return self._send_bytes(status, headers, body, path, rng, fault, head)

        try:
            target = m.path(path)
        except ValueError:
            return self._simple(403, b"forbidden\n", path, rng, fault, head)
        if target.is_dir():
            if not path.endswith("/"):
                return self._simple(301, b"", path, rng, fault, head, extra={"Location": path + "/"})
            index = target / "index.html"
            if index.is_file():
                target = index
            else:
                return self._simple(200, _listing(path, target), path, rng, fault, head,
                                    ctype="text/html; charset=utf-8")
        if not target.is_file():
            return self._simple(404, b"not found\n", path, rng, fault, head)
        self._send_file(target, path, rng, fault, head)

    def _simple(self, status, body, path, rng, fault, head, ctype="text/plain", extra=None):
        headers = {"Content-Type": ctype, **(extra or {})}
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        sent = 0
        if not head:
            self.mirror._add_bytes(path, len(body))
            self.wfile.write(body)
            sent = len(body)
        self.mirror._count(Request(self.command, path, status, rng, sent, fault))

    def _send_bytes(self, status, headers, body, path, rng, fault, head):
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        sent = 0
        if not head:
            sent = self._write_body(body, fault, path)
        self.mirror._count(Request(self.command, path, status, rng, sent, fault))

    def _send_file(self, target: Path, path: str, rng: str | None, fault: str | None, head: bool):
        st = target.stat()
        size = st.st_size
        etag = f'"{st.st_mtime_ns:x}-{size:x}"'
        start, end = 0, size - 1
        status = 200
        if rng:
            parsed = _parse_range(rng, size)
            if parsed is None:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                self.mirror._count(Request(self.command, path, 416, rng, 0, fault))
                return
            if parsed != "ignore":
                start, end = parsed
                status = 206
        length = max(0, end - start + 1)
        self.send_response(status)
        ctype = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        sent = 0
        if not head and length:
            with open(target, "rb") as fh:
                fh.seek(start)
                sent = self._write_body(_chunks(fh, length), fault, path)
        self.mirror._count(Request(self.command, path, status, rng, sent, fault))

    def _write_body(self, body, fault: str | None, path: str) -> int:
        """Write ``body`` (bytes or an iterator of chunks), applying stall/cut/slow. Returns bytes sent."""
        chunks = [body] if isinstance(body, (bytes, bytearray)) else body
        limit = int(fault.split(":")[1]) if fault and fault.startswith("cut:") else None
        rate = int(fault.split(":")[1]) if fault and fault.startswith("slow:") else None
        sent, started = 0, time.monotonic()
        try:
            if fault == "stall":
                self.wfile.flush()
                self.mirror._stop.wait(self.mirror.stall_s)
                self.close_connection = True
                return 0
            for chunk in chunks:
                if limit is not None and sent + len(chunk) > limit:
                    chunk = chunk[: limit - sent]
                if rate:
                    # a link of ``rate`` bytes/s: send in pieces of 1/100 s and sleep only while
                    # ahead of the schedule, so a slower client is not slowed further
                    step = max(1, rate // 100)
                    for i in range(0, len(chunk), step):
                        piece = chunk[i:i + step]
                        self.mirror._add_bytes(path, len(piece))
                        self.wfile.write(piece)
                        sent += len(piece)
                        ahead = started + sent / rate - time.monotonic()
                        if ahead > 0:
                            time.sleep(ahead)
                else:
                    self.mirror._add_bytes(path, len(chunk))
                    self.wfile.write(chunk)
                    sent += len(chunk)
                if limit is not None and sent >= limit:
                    break
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return sent
        if limit is not None:
            # end the connection mid-body, the way a dropped download looks to the client
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return sent


def _chunks(fh, length: int, size: int = 1 << 16):
    left = length
    while left > 0:
        data = fh.read(min(size, left))
        if not data:
            break
        left -= len(data)
        yield data


def _parse_range(header: str, size: int):
    """(start, end) for one ``bytes=`` range; None when unsatisfiable; "ignore" when unparseable."""
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if not m or (not m.group(1) and not m.group(2)):
        return "ignore"
    if m.group(1):
        start = int(m.group(1))
        end = int(m.group(2)) if m.group(2) else size - 1
        if start >= size:
            return None
        return start, min(end, size - 1)
    suffix = int(m.group(2))
    if suffix == 0:
        return None
    return max(0, size - suffix), size - 1


def _listing(url_path: str, folder: Path) -> bytes:
    items = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    links = "\n".join(f'<a href="{urllib.parse.quote(n)}">{html.escape(n)}</a><br>' for n in items)
    return (f"<!DOCTYPE html><html><head><title>Index of {html.escape(url_path)}</title></head>"
            f"<body><h1>Index of {html.escape(url_path)}</h1>\n{links}\n</body></html>\n").encode()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Serve a lab mirror root on 127.0.0.1")
    ap.add_argument("--root", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", help="write the bound port here once listening")
    args = ap.parse_args(argv)
    mirror = Mirror(args.root, port=args.port).start()
    if args.port_file:
        tmp = args.port_file + ".tmp"
        Path(tmp).write_text(str(mirror.port))
        os.replace(tmp, args.port_file)
    print(f"lab mirror: {mirror.url} serving {mirror.root}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        mirror.stop()


if __name__ == "__main__":
    main()
