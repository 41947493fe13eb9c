"""The driver stage's apt sources (pure): the box's enabled ``deb`` entries, the archive components
the driver packages live in added for the box's own mirrors and suites, and the running kernel's
headers DKMS builds the module with."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from tasks.driver.choice import Distro

# ---------------------------------------------------------------- apt sources (pure)


def parse_sources(files: Mapping[str, str]) -> list[dict]:
    """apt sources (one-line ``.list`` and deb822 ``.sources``) -> [{"uris", "suites", "components",
    "signed_by"}] of the enabled ``deb`` entries."""
    entries = []
    for path, text in sorted(files.items()):
        if path.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                fields: dict[str, str] = {}
                key = None
                for line in stanza.splitlines():
                    if line.startswith("#"):
                        continue
                    if line[:1] in (" ", "\t") and key:
                        fields[key] += " " + line.strip()
                    elif ":" in line:
                        key, _, value = line.partition(":")
                        key = key.strip().lower()
                        fields[key] = value.strip()
                if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes").lower() != "no":
                    entries.append({"uris": fields.get("uris", "").split(), "suites": fields.get("suites", "").split(),
                                    "components": fields.get("components", "").split(),
                                    "signed_by": fields.get("signed-by", "").split()[0] if fields.get("signed-by") else ""})
            continue
        for line in text.splitlines():
            m = re.match(r"^\s*deb\s+(?:\[(?P<opts>[^\]]*)\]\s+)?(?P<uri>\S+)\s+(?P<suite>\S+)\s*(?P<comps>.*)$", line)
            if m:
                opts = dict(o.split("=", 1) for o in (m.group("opts") or "").split() if "=" in o)
                entries.append({"uris": [m.group("uri")], "suites": [m.group("suite")],
                                "components": m.group("comps").split("#")[0].split(),
                                "signed_by": opts.get("signed-by", "")})
    return entries


ARCHIVE_HOSTS = {"Debian": ("deb.debian.org", "security.debian.org", "ftp.debian.org"),
                 "Ubuntu": ("archive.ubuntu.com", "security.ubuntu.com", "ports.ubuntu.com")}


def list_name(uri: str, suite: str) -> str:
    """apt's name for a suite's lists under /var/lib/apt/lists (its URItoFileName, less the file):
    "http://deb.debian.org/debian" + "bookworm" -> "deb.debian.org_debian_dists_bookworm"."""
    bare = re.sub(r"^[a-z0-9+]+://", "", uri).rstrip("/")
    return f"{bare}/dists/{suite}".replace("%", "%25").replace(":", "%3a").replace("/", "_")


def of_the_distro(uri: str, suite: str, origins: Mapping[str, str], origin: str) -> bool:
    """Is this (URI, suite) the distro's own archive? The Origin of its Release file where apt has
    fetched it; else (lists not fetched yet) one of the archive's own hosts or their mirrors
    (``<cc>.archive.ubuntu.com``). A vendor's repository with a ``main`` component is not."""
    known = origins.get(list_name(uri, suite))
    if known is not None:
        return known == origin
    host = re.sub(r"^[a-z0-9+]+://", "", uri).split("/")[0].split("@")[-1].split(":")[0]
    return any(host == h or host.endswith("." + h) for h in ARCHIVE_HOSTS.get(origin, ()))


def sources_to_add(entries: Sequence[Mapping], components: Sequence[str], origins: Mapping[str, str] | None = None,
                   origin: str = "") -> str:
    """The deb822 text that adds ``components`` to every (URI, suite) of the distro's own archive
    (``of_the_distro``; every one where ``origin`` is "") whose entries carry ``main`` without them;
    "" when nothing is missing."""
    have: dict[tuple[str, str], set[str]] = {}
    signed: dict[str, str] = {}
    for e in entries:
        for uri in e["uris"]:
            for suite in e["suites"]:
                have.setdefault((uri, suite), set()).update(e["components"])
                signed.setdefault(uri, e.get("signed_by") or "")
    missing: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for (uri, suite), comps in have.items():
        lack = tuple(c for c in components if c not in comps)
        if "main" in comps and lack and (not origin or of_the_distro(uri, suite, origins or {}, origin)):
            missing.setdefault((uri, lack), []).append(suite)
    stanzas = []
    for (uri, lack), suites in sorted(missing.items()):
        lines = ["Types: deb", f"URIs: {uri}", f"Suites: {' '.join(suites)}", f"Components: {' '.join(lack)}"]
        if signed.get(uri):
            lines.append(f"Signed-By: {signed[uri]}")
        stanzas.append("\n".join(lines) + "\n")
    if not stanzas:
        return ""
    return ("# verl-lab driver stage: the archive components the NVIDIA driver packages live in, for this box's\n"
            "# own mirrors and suites.\n\n" + "\n".join(stanzas))


def headers_packages(distro: Distro, kernel: str) -> tuple[str, ...]:
    """The running kernel's headers (DKMS builds the module against them) and, on Debian, the
    flavour's headers metapackage, so the next kernel the archive brings gets its headers too
    (Ubuntu's linux-generic already depends on linux-headers-generic)."""
    out = [f"linux-headers-{kernel}"]
    # 6.1.0-26-amd64 (bookworm), 6.12.12+bpo-amd64 (bookworm-backports), 6.12.12-amd64 (trixie's scheme)
    m = re.match(r"^\d+\.\d+(?:\.\d+)?(?:-\d+)?(?P<bpo>\+bpo)?-(?P<flavour>(?:cloud-|rt-)?"
                 r"(?:amd64|arm64|686-pae|686|armmp-lpae|armmp|powerpc64le|s390x|riscv64|loong64|rpi|marvell))$", kernel)
    if distro.id == "debian" and m:
        # a backports kernel's metapackage comes from backports (the suite's own is the older kernel's)
        suite = f"/{distro.codename}-backports" if m.group("bpo") and distro.codename else ""
        out.append(f"linux-headers-{m.group('flavour')}{suite}")
    return tuple(out)
