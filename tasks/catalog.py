"""The catalog: every external artifact verl-lab installs, read from ``files/catalog.toml``.

Pure: no pyinfra, no network. A stage asks ``catalog.artifact("cudnn_archive")`` and
``artifact.url(mirrors)`` for where to get it under the host's mirror profile.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parent.parent
CATALOG_PATH = REPO_ROOT / "files" / "catalog.toml"

ARTIFACT_KINDS = ("file", "git", "pip-index", "hf-model", "hf-dataset")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# Fields a host may override on an artifact (catalog_overrides), with their types.
OVERRIDABLE = {
    "sha256": str,
    "size": int,
    "path": str,
    "ref": str,
    "revision": str,
    "repo": str,
    "version": str,
    "requirements": list,
    "files": dict,
    "splits": dict,
    "no_checksum": str,
    "cuda": str,
}


class CatalogError(ValueError):
    """A catalog entry, a lookup or an override is wrong. The message says how to fix it."""


def check_base_url(url: Any) -> str | None:
    """Return why ``url`` is not a usable base URL, or None when it is."""
    if not isinstance(url, str) or not url.strip():
        return "must be a non-empty string"
    if url != url.strip():
        return "has leading or trailing whitespace"
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https", "file"):
        return f"scheme must be http, https or file, not {parsed.scheme or 'missing'!r}"
    if parsed.scheme != "file" and not parsed.netloc:
        return "has no host name"
    if parsed.query or parsed.fragment:
        return "must not carry a query or fragment"
    return None


@dataclass(frozen=True)
class MirrorSet:
    """Base URLs for every source under one profile, after the host's overrides."""

    profile: str
    bases: Mapping[str, str]

    def base(self, source: str) -> str:
        try:
            return self.bases[source].rstrip("/")
        except KeyError:
            raise CatalogError(
                f"no base URL for source {source!r}; known sources: {', '.join(sorted(self.bases))}"
            ) from None


@dataclass(frozen=True)
class Artifact:
    name: str
    kind: str
    source: str
    version: str
    path: str = ""
    sha256: str | None = None
    size: int | None = None
    no_checksum: str | None = None
    ref: str | None = None
    repo: str | None = None
    revision: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def filename(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    def url(self, mirrors: MirrorSet) -> str:
        """Where to get this artifact (file, git repo, index or HF endpoint)."""
        base = mirrors.base(self.source)
        if self.kind in ("hf-model", "hf-dataset"):
            return base
        return f"{base}/{self.path.lstrip('/')}" if self.path else base

    def get(self, key: str, default: Any = None) -> Any:
        return self.extra.get(key, default)


def _artifact_from(name: str, entry: Mapping[str, Any], sources: Mapping[str, Any]) -> Artifact:
    def bad(msg: str) -> CatalogError:
        return CatalogError(f"catalog artifact {name!r}: {msg}")

    kind = entry.get("kind")
    if kind not in ARTIFACT_KINDS:
        raise bad(f"kind {kind!r} is not one of {', '.join(ARTIFACT_KINDS)}")
    source = entry.get("source")
    if not isinstance(source, str) or source not in sources:
        raise bad(f"source {source!r} is not a [sources] entry ({', '.join(sorted(sources))})")
    if not entry.get("version"):
        raise bad("has no version")
    sha = entry.get("sha256")
    if sha is not None and not SHA256_RE.match(str(sha)):
        raise bad(f"sha256 {sha!r} is not 64 lowercase hex digits")
    reason = entry.get("no_checksum")
    if sha is None and not reason and kind == "file":
        raise bad("has no sha256; add one, or a `no_checksum` line saying why it has none")
    if kind != "file" and sha is None and not reason and not entry.get("files"):
        raise bad("has no sha256 or files checksums; add a `no_checksum` line saying why")
    size = entry.get("size")
    if size is not None and (not isinstance(size, int) or size <= 0):
        raise bad(f"size {size!r} must be a positive integer of bytes")
    if kind in ("file", "git", "pip-index") and not entry.get("path"):
        raise bad("has no path")
    if kind == "git" and not entry.get("ref"):
        raise bad("a git artifact needs a ref (tag or commit)")
    if kind in ("hf-model", "hf-dataset") and not (entry.get("repo") and entry.get("revision")):
        raise bad("a Hugging Face artifact needs repo and revision")
    for fname, spec in (entry.get("files") or {}).items():
        fsha = spec.get("sha256")
        if fsha is not None and not SHA256_RE.match(str(fsha)):
            raise bad(f"files.{fname}.sha256 {fsha!r} is not 64 lowercase hex digits")
    known = {"kind", "source", "version", "path", "sha256", "size", "no_checksum", "ref", "repo", "revision"}
    return Artifact(
        name=name,
        kind=kind,
        source=source,
        version=str(entry["version"]),
        path=entry.get("path", ""),
        sha256=sha,
        size=size,
        no_checksum=reason,
        ref=entry.get("ref"),
        repo=entry.get("repo"),
        revision=entry.get("revision"),
        extra={k: v for k, v in entry.items() if k not in known},
    )


@dataclass(frozen=True)
class Catalog:
    profiles: tuple[str, ...]
    sources: Mapping[str, Mapping[str, str]]
    artifacts: Mapping[str, Artifact]

    @classmethod
    def load(cls, path: Path | str = CATALOG_PATH) -> Catalog:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        return cls.from_dict(data, origin=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "<catalog>") -> Catalog:
        profiles = tuple(data.get("profiles") or ())
        if not profiles:
            raise CatalogError(f"{origin}: `profiles` lists no mirror profile")
        sources = data.get("sources") or {}
        for sname, sdef in sources.items():
            for prof in profiles:
                why = check_base_url(sdef.get(prof))
                if why:
                    raise CatalogError(f"{origin}: sources.{sname}.{prof} {why}")
        artifacts = {
            name: _artifact_from(name, entry, sources)
            for name, entry in (data.get("artifacts") or {}).items()
        }
        return cls(profiles=profiles, sources=sources, artifacts=artifacts)

    def model(self, name_or_repo: object) -> Artifact | None:
        """A model artifact (kind hf-model) by its artifact name or its Hugging Face repo, any case."""
        want = str(name_or_repo).lower() if isinstance(name_or_repo, str) else None
        return next((a for name, a in self.artifacts.items() if a.kind == "hf-model"
                     and want in (name.lower(), (a.repo or "").lower())), None)

    def artifact(self, name: str) -> Artifact:
        try:
            return self.artifacts[name]
        except KeyError:
            raise CatalogError(
                f"unknown artifact {name!r}; the catalog has: {', '.join(sorted(self.artifacts))}"
            ) from None

    def mirrors(self, profile: str, overrides: Mapping[str, str] | None = None) -> MirrorSet:
        if profile not in self.profiles:
            raise CatalogError(
                f"unknown mirror profile {profile!r}; use one of {', '.join(self.profiles)}"
                " (or keep one and replace single sources with mirror_urls)"
            )
        bases = {name: sdef[profile] for name, sdef in self.sources.items()}
        for source, url in (overrides or {}).items():
            if source not in self.sources:
                raise CatalogError(
                    f"mirror_urls names unknown source {source!r}; known: {', '.join(sorted(self.sources))}"
                )
            why = check_base_url(url)
            if why:
                raise CatalogError(f"mirror_urls.{source} = {url!r} {why}")
            bases[source] = url
        return MirrorSet(profile=profile, bases=bases)

    def with_overrides(self, overrides: Mapping[str, Mapping[str, Any]] | None) -> Catalog:
        """A copy with fields of named artifacts replaced (e.g. a test's own checksums)."""
        if not overrides:
            return self
        arts = dict(self.artifacts)
        for name, fields in overrides.items():
            art = self.artifact(name)
            if not isinstance(fields, Mapping):
                raise CatalogError(f"catalog_overrides.{name} must be a mapping of field -> value")
            changes: dict[str, Any] = {}
            extra = dict(art.extra)
            for key, value in fields.items():
                want = OVERRIDABLE.get(key)
                if want is None:
                    raise CatalogError(
                        f"catalog_overrides.{name}.{key}: not an overridable field;"
                        f" use one of {', '.join(sorted(OVERRIDABLE))}"
                    )
                if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                    raise CatalogError(f"catalog_overrides.{name}.{key} must be {want.__name__}")
                if key == "sha256" and not SHA256_RE.match(str(value)):
                    raise CatalogError(f"catalog_overrides.{name}.sha256 {value!r} is not 64 lowercase hex digits")
                if key in Artifact.__dataclass_fields__:
                    changes[key] = value
                else:  # requirements, files, splits, cuda, ... live in extra
                    extra[key] = value
            arts[name] = replace(art, extra=extra, **changes)
        return replace(self, artifacts=arts)


_DEFAULT: Catalog | None = None


def default_catalog() -> Catalog:
    """The repo's catalog, parsed once per process."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Catalog.load()
    return _DEFAULT
