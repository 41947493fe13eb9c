"""One pinned snapshot of a Hugging Face repo, downloaded, verified and swapped into place.

Runs in two places with the same code: on the controller (relay mode, imported by
``tasks/data.py``) and on a box (direct mode, pushed there and run with the env's python:
``python hfsnapshot.py fetch --spec spec.json --dest DIR``). No pyinfra import; only the
``fetch`` path needs ``huggingface_hub`` (imported late), ``install`` and ``prove`` need only
the standard library, so relay boxes need no Hub client at all.

How a fetch goes:

1. The file list of the pinned revision is asked of the endpoint first (``list_repo_tree``),
   so a wrong endpoint, repo or revision fails with a message naming the endpoint, the repo,
   the revision and the fix, before anything is written. (``snapshot_download`` itself would
   fall back to "whatever is on disk" when the endpoint is unreachable.)
2. Files are fetched into ``<dest>.staging/``, never into ``<dest>``. LFS files (the weights,
   the parquet files) are fetched by this module with HTTP ranges into ``.part`` files that
   survive a cut connection or a killed run, so the next run resumes where this one stopped
   (huggingface_hub >= 1.0 deletes its partial files on failure). ``snapshot_download`` then
   fetches the small files and checks the LFS ones against the Hub's sha256 ETags.
3. Every file is checked: the size the endpoint lists, the sha256 the endpoint lists for LFS
   files, and the catalog's ``files`` sizes / sha256 where given; a model's ``config.json``
   must parse and name a ``model_type``. A bad file is deleted (the next run fetches it again).
4. Only then is the staging folder renamed to ``<dest>``, and ``<dest>.verified.json`` (the spec
   digest and every file's size and sha256) written beside it. A later fetch with the same spec
   finds the stamp and does nothing, without network access.

An HF token is read from a file (``--token-file``) or passed in-process; it is never printed,
never put in argv, and only sent to the endpoint's own host (not across redirects to others).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# What a model snapshot needs: weights in safetensors, configs, tokenizer files. Not other
# weight formats (pytorch_model.bin, onnx/, flax, gguf), which can be many times larger.
MODEL_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.py", "LICENSE*", "README.md")
CHUNK = 1 << 20
RANGE_RETRIES = 3
RETRY_SLEEP_S = 1.0                    # times the attempt number, between ranged retries
CONNECT_TIMEOUT_S = 15
TIMEOUT_S = 60
MIRROR_FIX = ("set mirror_profile = 'cn' (hf-mirror.com) or mirror_urls = {'huggingface': '<a reachable Hub "
              "endpoint>'} in the inventory")


class SnapshotError(RuntimeError):
    """A snapshot could not be fetched or proven; the message names what and the fix."""


@dataclass(frozen=True)
class RepoSpec:
    """What to fetch: a repo at a pinned commit, which files, and what they must be."""

    artifact: str                      # catalog artifact name (for messages: catalog_overrides.<artifact>)
    repo: str
    revision: str
    repo_type: str                     # "model" | "dataset"
    files: dict = field(default_factory=dict)   # name -> {"size": int, "sha256": str, ...}
    patterns: tuple[str, ...] = ()     # allow patterns; () = exactly the names in ``files``

    def __post_init__(self):
        if self.repo_type not in ("model", "dataset"):
            raise SnapshotError(f"{self.artifact}: repo_type {self.repo_type!r} is not model or dataset")
        if not COMMIT_RE.match(self.revision or ""):
            raise SnapshotError(
                f"{self.artifact}: revision {self.revision!r} of {self.repo} is not a 40-digit commit sha; "
                f"branches and tags move. Fix: pin a commit in catalog_overrides.{self.artifact}.revision")

    @property
    def allow(self) -> list[str]:
        return list(self.patterns) if self.patterns else sorted(self.files)

    def wants(self, name: str) -> bool:
        return any(fnmatch.fnmatch(name, pat) for pat in self.allow)

    def to_json(self) -> dict:
        return {"artifact": self.artifact, "repo": self.repo, "revision": self.revision,
                "repo_type": self.repo_type, "files": self.files, "patterns": list(self.patterns)}

    @classmethod
    def from_json(cls, data: dict) -> RepoSpec:
        return cls(artifact=data["artifact"], repo=data["repo"], revision=data["revision"],
                   repo_type=data["repo_type"], files=dict(data.get("files") or {}),
                   patterns=tuple(data.get("patterns") or ()))

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    @property
    def label(self) -> str:
        return f"{self.repo_type} repo {self.repo!r} at revision {self.revision}"


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None                 # known for LFS files


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def stamp_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified.json")


def staging_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".staging")


def read_stamp(dest: Path) -> dict | None:
    try:
        return json.loads(stamp_path(dest).read_text())
    except (OSError, ValueError):
        return None


def stamp_matches(dest: Path, spec: RepoSpec) -> bool:
    """The folder is as verified for this spec (sizes re-checked; sha256 trusted from the stamp)."""
    stamp = read_stamp(dest)
    if not stamp or stamp.get("digest") != spec.digest:
        return False
    for name, info in (stamp.get("files") or {}).items():
        path = dest / name
        if not path.is_file() or path.stat().st_size != info["size"]:
            return False
    return bool(stamp.get("files"))


# ---------------------------------------------------------------- talking to the endpoint

def explain(exc: BaseException, spec: RepoSpec, endpoint: str) -> SnapshotError:
    """Turn a huggingface_hub / network error into a message with the endpoint, repo, revision and fix."""
    from huggingface_hub import errors as hf_errors

    where = f"{spec.label} from HF endpoint {endpoint}"
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return SnapshotError(f"{where}: the endpoint has no such revision. Fix: pin an existing commit in "
                             f"catalog_overrides.{spec.artifact}.revision")
    if isinstance(exc, hf_errors.GatedRepoError):
        return SnapshotError(f"{where}: the repo is gated. Fix: accept its terms on the Hub and set "
                             f"hf_token_file (or HF_TOKEN on the controller)")
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        return SnapshotError(f"{where}: the endpoint has no such repo (or it is private). Fix: check "
                             f"catalog_overrides.{spec.artifact}.repo, set hf_token_file for a private repo, "
                             f"or {MIRROR_FIX} if this mirror does not carry it")
    if isinstance(exc, hf_errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        return SnapshotError(f"{where}: the endpoint answered HTTP {status}. Fix: retry later, or {MIRROR_FIX}")
    if isinstance(exc, ValueError):  # JSON decode: an HTML page or some other web server
        return SnapshotError(f"{where}: the endpoint did not answer the Hub API (not JSON: an HTML login, "
                             f"captcha or error page?). Fix: {MIRROR_FIX}")
    return SnapshotError(f"{where}: cannot reach the endpoint ({type(exc).__name__}: {exc}). Fix: {MIRROR_FIX}")


def check_reachable(spec: RepoSpec, endpoint: str) -> None:
    """Fail fast (one TCP connect) when nothing listens at the endpoint, instead of the Hub
    client's retries with backoff."""
    url = urllib.parse.urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise SnapshotError(f"{spec.label} from HF endpoint {endpoint}: cannot reach the endpoint "
                            f"({url.hostname}:{port}: {exc}). Fix: {MIRROR_FIX}") from None


def list_remote(spec: RepoSpec, endpoint: str, token: str | None) -> dict[str, RemoteFile]:
    """The wanted files of the pinned revision, as the endpoint lists them; clear errors otherwise."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    check_reachable(spec, endpoint)
    api = HfApi(endpoint=endpoint, token=token or False)
    try:
        entries = list(api.list_repo_tree(spec.repo, revision=spec.revision, repo_type=spec.repo_type,
                                          recursive=True))
    except Exception as exc:  # every failure is reported the same way: what, where, fix
        raise explain(exc, spec, endpoint) from None
    listing = {e.path: RemoteFile(e.path, int(e.size), e.lfs.sha256 if e.lfs else None)
               for e in entries if isinstance(e, RepoFile)}
    if not listing:
        raise SnapshotError(f"{spec.label} from HF endpoint {endpoint}: the revision lists no files. "
                            f"Fix: {MIRROR_FIX}")
    missing = [n for n in spec.files if n not in listing]
    if missing:
        raise SnapshotError(f"{spec.label} from HF endpoint {endpoint} has no {', '.join(missing)} that the "
                            f"catalog expects. Fix: correct catalog_overrides.{spec.artifact}.files or the revision")
    wanted = {n: f for n, f in listing.items() if spec.wants(n)}
    if not wanted:
        raise SnapshotError(f"{spec.label}: no file matches {', '.join(spec.allow)}")
    for name, f in wanted.items():
        want = spec.files.get(name) or {}
        if want.get("size") is not None and want["size"] != f.size:
            raise SnapshotError(f"{spec.label} from {endpoint}: {name} is listed with {f.size} bytes, the catalog "
                                f"says {want['size']}. The endpoint serves other content than the catalog pins; "
                                f"nothing was downloaded. Fix: {MIRROR_FIX}, or correct the catalog entry")
        if want.get("sha256") and f.sha256 and want["sha256"] != f.sha256:
            raise SnapshotError(f"{spec.label} from {endpoint}: {name} is listed with sha256 {f.sha256}, the "
                                f"catalog says {want['sha256']}. Fix: {MIRROR_FIX}, or correct the catalog entry")
    return wanted


class _SameHostRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects, but never carry the Authorization header to another host (a CDN)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.headers.pop("Authorization", None)
            new.unredirected_hdrs.pop("Authorization", None)
        return new


def resolve_url(endpoint: str, spec: RepoSpec, name: str) -> str:
    prefix = "datasets/" if spec.repo_type == "dataset" else ""
    return (f"{endpoint.rstrip('/')}/{prefix}{spec.repo}/resolve/{spec.revision}/"
            f"{urllib.parse.quote(name)}")


def fetch_resumable(url: str, part: Path, size: int, token: str | None, progress: bool) -> None:
    """GET ``url`` into ``part``, resuming from what ``part`` already holds. Raises OSError when cut."""
    opener = urllib.request.build_opener(_SameHostRedirects)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=size, initial=min(part.stat().st_size if part.exists() else 0, size), unit="B",
                   unit_scale=True, unit_divisor=1024, desc=part.name.removesuffix(".part"), leave=False)
    try:
        for attempt in range(1, RANGE_RETRIES + 1):
            have = part.stat().st_size if part.exists() else 0
            if have > size:
                part.unlink()
                have = 0
            if have == size:
                return
            req = urllib.request.Request(url, headers={"Range": f"bytes={have}-", "Accept-Encoding": "identity",
                                                       "User-Agent": "verl-lab"})
            if token:
                req.add_unredirected_header("Authorization", f"Bearer {token}")
            try:
                with opener.open(req, timeout=TIMEOUT_S) as resp:
                    ctype = resp.headers.get("Content-Type", "")
                    if "text/html" in ctype:
                        raise SnapshotError(f"{url} answered an HTML page (Content-Type {ctype!r}), not the file. "
                                            f"Fix: {MIRROR_FIX}")
                    mode = "ab" if resp.status == 206 else "wb"   # 200: the server ignored Range
                    if mode == "wb" and bar is not None:
                        bar.reset(total=size)
                    with open(part, mode) as out:
                        for block in iter(lambda: resp.read(CHUNK), b""):
                            out.write(block)
                            if bar is not None:
                                bar.update(len(block))
            except urllib.error.HTTPError as exc:
                if exc.code == 416 and have:
                    return
                raise SnapshotError(f"{url} answered HTTP {exc.code}. Fix: {MIRROR_FIX}") from None
            except (OSError, ValueError) as exc:  # cut connection, reset, timeout, incomplete read
                if attempt == RANGE_RETRIES:
                    got = part.stat().st_size if part.exists() else 0
                    raise OSError(f"download of {url} was cut at {got} of {size} bytes ({exc}); the partial "
                                  f"file {part} is kept and the next run resumes it") from None
                time.sleep(RETRY_SLEEP_S * attempt)
                continue
            if part.stat().st_size >= size:
                return
            time.sleep(RETRY_SLEEP_S * attempt)  # closed early without an error: retry from where it stopped
        got = part.stat().st_size if part.exists() else 0
        raise OSError(f"download of {url} was cut at {got} of {size} bytes (connection closed early); the "
                      f"partial file {part} is kept and the next run resumes it")
    finally:
        if bar is not None:
            bar.close()


# ---------------------------------------------------------------- verification

def verify_files(root: Path, expected: dict[str, dict], label: str, delete_bad: bool = True) -> dict[str, dict]:
    """Check every expected file under ``root``; return {name: {size, sha256}} or raise, deleting bad files."""
    found: dict[str, dict] = {}
    problems: list[str] = []
    for name, want in sorted(expected.items()):
        path = root / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if want.get("size") is not None and size != want["size"]:
            problems.append(f"{name} has {size} bytes, expected {want['size']} (truncated?)")
            if delete_bad:
                path.unlink()
            continue
        sha = sha256_of(path)
        if want.get("sha256") and sha != want["sha256"]:
            problems.append(f"{name} has sha256 {sha}, expected {want['sha256']}")
            if delete_bad:
                path.unlink()
            continue
        found[name] = {"size": size, "sha256": sha}
    if problems:
        raise SnapshotError(f"{label}: " + "; ".join(problems)
                            + (". Bad files were deleted; the next run fetches them again." if delete_bad else ""))
    return found


def check_model_config(root: Path, label: str) -> str:
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{label}: config.json is not readable JSON ({exc})") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise SnapshotError(f"{label}: config.json names no model_type")
    return str(config["model_type"])


def expected_files(spec: RepoSpec, listing: dict[str, RemoteFile]) -> dict[str, dict]:
    out = {}
    for name, remote in listing.items():
        want = dict(spec.files.get(name) or {})
        want.setdefault("size", remote.size)
        if remote.sha256:
            want.setdefault("sha256", remote.sha256)
        out[name] = {k: want[k] for k in ("size", "sha256") if k in want}
    return out


def swap_in(staging: Path, dest: Path, spec: RepoSpec, verified: dict[str, dict]) -> None:
    """Replace ``dest`` by the verified ``staging`` folder, then write the stamp."""
    shutil.rmtree(staging / ".cache", ignore_errors=True)
    shutil.rmtree(staging / ".parts", ignore_errors=True)
    stamp = stamp_path(dest)
    stamp.unlink(missing_ok=True)
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(staging, dest)
    shutil.rmtree(old, ignore_errors=True)
    tmp = stamp.with_name(stamp.name + ".tmp")
    tmp.write_text(json.dumps({"digest": spec.digest, "repo": spec.repo, "revision": spec.revision,
                               "repo_type": spec.repo_type, "files": verified}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, stamp)


# On the controller, pyinfra prepares every host as a greenlet of one process (gevent makes
# threading.Lock cooperative): hosts queue on this in-process lock first, since a second
# flock() of the same file in the same process would block the whole process for good.
_IN_PROCESS: dict[str, threading.Lock] = {}
_IN_PROCESS_GUARD = threading.Lock()


@contextlib.contextmanager
def _locked(dest: Path):
    import fcntl

    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.with_name(dest.name + ".lock")
    with _IN_PROCESS_GUARD:
        in_process = _IN_PROCESS.setdefault(str(lock_path), threading.Lock())
    with in_process, open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def fetch(spec: RepoSpec, dest: Path, endpoint: str, token: str | None = None, progress: bool = True,
          max_workers: int = 4) -> dict[str, dict]:
    """Make ``dest`` a verified snapshot of ``spec``; return {name: {size, sha256}}."""
    dest = Path(dest)
    with _locked(dest):
        if stamp_matches(dest, spec):
            return read_stamp(dest)["files"]
        listing = list_remote(spec, endpoint, token)
        staging = staging_path(dest)
        staging.mkdir(parents=True, exist_ok=True)
        expected = expected_files(spec, listing)
        # Large (LFS) files first, resumably; a killed run leaves .part files to resume.
        for name, remote in listing.items():
            final = staging / name
            if remote.sha256 is None or (final.is_file() and final.stat().st_size == remote.size):
                continue
            part = staging / ".parts" / (name + ".part")
            part.parent.mkdir(parents=True, exist_ok=True)
            fetch_resumable(resolve_url(endpoint, spec, name), part, remote.size, token, progress)
            got = sha256_of(part)
            if got != expected[name].get("sha256", got):
                part.unlink()
                raise SnapshotError(f"{spec.label} from {endpoint}: {name} has sha256 {got}, expected "
                                    f"{expected[name]['sha256']}; deleted. Fix: {MIRROR_FIX}")
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, final)
        _snapshot(spec, staging, endpoint, token, list(listing), progress, max_workers)
        verified = verify_files(staging, expected, f"{spec.label} from {endpoint}")
        if spec.repo_type == "model":
            check_model_config(staging, f"{spec.label} from {endpoint}")
        swap_in(staging, dest, spec, verified)
        return verified


def _snapshot(spec: RepoSpec, staging: Path, endpoint: str, token: str | None, names: list[str],
              progress: bool, max_workers: int) -> None:
    from huggingface_hub import snapshot_download

    if not progress:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        snapshot_download(spec.repo, repo_type=spec.repo_type, revision=spec.revision, local_dir=str(staging),
                          allow_patterns=names, endpoint=endpoint, token=token or False, max_workers=max_workers)
    except Exception as exc:
        if isinstance(exc, OSError) and not type(exc).__module__.startswith("huggingface_hub"):
            raise SnapshotError(f"{spec.label} from {endpoint}: download failed ({exc}); completed files are "
                                f"kept in {staging} and the next run continues. Fix: retry, or {MIRROR_FIX}") from None
        raise explain(exc, spec, endpoint) from None


def install(spec: RepoSpec, staging: Path, dest: Path, manifest: dict[str, dict]) -> dict[str, dict]:
    """Relay mode on the box: verify files uploaded into ``staging`` against ``manifest``, then swap in."""
    dest = Path(dest)
    with _locked(dest):
        if stamp_matches(dest, spec):
            return read_stamp(dest)["files"]
        verified = verify_files(Path(staging), manifest, f"{spec.label} (pushed from the controller)")
        if spec.repo_type == "model":
            check_model_config(Path(staging), spec.label)
        swap_in(Path(staging), dest, spec, verified)
        return verified


def prove(spec: RepoSpec, dest: Path) -> dict:
    """The stage proof: the stamp is for this spec, every file has its size and sha256, config.json reads."""
    dest = Path(dest)
    stamp = read_stamp(dest)
    if not stamp or stamp.get("digest") != spec.digest:
        raise SnapshotError(f"{spec.label}: {dest} is not a verified snapshot of this spec")
    expected = {n: dict(i) for n, i in stamp["files"].items()}
    for name, want in spec.files.items():
        if name not in expected:
            raise SnapshotError(f"{spec.label}: {name} (in the catalog) is not in {dest}")
        expected[name].update({k: v for k, v in want.items() if k in ("size", "sha256")})
    verified = verify_files(dest, expected, f"{spec.label} at {dest}", delete_bad=False)
    result = {"dir": str(dest), "files": len(verified), "bytes": sum(v["size"] for v in verified.values())}
    if spec.repo_type == "model":
        result["model_type"] = check_model_config(dest, spec.label)
    return result


# ---------------------------------------------------------------- command line (box side)

def _read_token(path: str | None) -> str | None:
    if not path:
        return None
    token = Path(path).read_text().strip()
    return token or None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hfsnapshot", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download, verify and swap in a snapshot (direct mode)")
    f.add_argument("--spec", required=True)
    f.add_argument("--dest", required=True)
    f.add_argument("--endpoint", default=os.environ.get("HF_ENDPOINT"))
    f.add_argument("--token-file", help="a file holding an HF token (never pass the token itself)")
    f.add_argument("--progress", action="store_true")
    i = sub.add_parser("install", help="verify an uploaded staging folder and swap it in (relay mode)")
    i.add_argument("--spec", required=True)
    i.add_argument("--staging", required=True)
    i.add_argument("--dest", required=True)
    i.add_argument("--manifest", required=True)
    p = sub.add_parser("prove", help="prove a snapshot folder matches its spec")
    p.add_argument("--spec", required=True)
    p.add_argument("--dest", required=True)
    args = ap.parse_args(argv)
    try:
        spec = RepoSpec.from_json(json.loads(Path(args.spec).read_text()))
        if args.cmd == "fetch":
            if not args.endpoint:
                raise SnapshotError("no HF endpoint: pass --endpoint or set HF_ENDPOINT")
            files = fetch(spec, Path(args.dest), args.endpoint, _read_token(args.token_file), args.progress)
            print(f"fetched {spec.label}: {len(files)} files verified in {args.dest}")
        elif args.cmd == "install":
            manifest = json.loads(Path(args.manifest).read_text())
            files = install(spec, Path(args.staging), Path(args.dest), manifest)
            print(f"installed {spec.label}: {len(files)} files verified in {args.dest}")
        else:
            print(json.dumps(prove(spec, Path(args.dest)), sort_keys=True))
    except (SnapshotError, OSError) as exc:
        print(f"verl-lab data: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
