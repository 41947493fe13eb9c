"""verl at its pinned tag, cloned from the catalog's git URL and patched with version-pinned diffs.

The patches live in ``files/patches/verl-<version>/`` as unified diffs made against verl's own
sources (never a sed). On the box each is applied idempotently: ``git apply --reverse --check``
says it is already in; otherwise ``git apply --check`` must pass before ``git apply``.
"""

from __future__ import annotations

from pathlib import Path

from tasks.catalog import REPO_ROOT

PATCH_ROOT = REPO_ROOT / "files" / "patches"


class PatchSetError(ValueError):
    """No patch set for the verl version the catalog pins."""


def patch_dir(version: str = "0.5.0") -> Path:
    return PATCH_ROOT / f"verl-{version}"


def patch_files(version: str = "0.5.0") -> list[Path]:
    """The patch set for ``version``, in the order it is applied."""
    found = sorted(patch_dir(version).glob("*.diff"))
    if not found:
        raise PatchSetError(
            f"no patches in {patch_dir(version)} for verl {version}: the patches are version-pinned;"
            " make a set for this version (unified diffs against its sources) or pin verl 0.5.0"
        )
    return found


# ------------------------------------------------------------------ the pyinfra part

import shlex  # noqa: E402

from pyinfra import host  # noqa: E402
from pyinfra.api import StringCommand, deploy, operation  # noqa: E402
from pyinfra.operations import files  # noqa: E402

from tasks.facts.pyenv import VerlCheckout  # noqa: E402
from tasks.settings import LabSettings  # noqa: E402


def box_patch_paths(settings: LabSettings, version: str) -> list[str]:
    return [f"{settings.lab_root}/patches/verl-{version}/{p.name}" for p in patch_files(version)]


@operation()
def verl_clone(settings: LabSettings):
    """Clone verl at the catalog's tag into verl_src (a clone at another commit is replaced)."""
    art = settings.catalog.artifact("verl")
    have = host.get_fact(VerlCheckout, path=settings.verl_src, ref=art.ref, patches=[])
    if have and have["at_ref"]:
        host.noop(f"verl {art.ref} already at {settings.verl_src}")
        return
    src, part, url, ref = (shlex.quote(x) for x in (settings.verl_src, settings.verl_src + ".part",
                                                    art.url(settings.mirrors), art.ref))
    clone = f"git -c advice.detachedHead=false clone -q --branch {ref}"
    yield StringCommand("sh", "-c", shlex.quote(
        f"set -e; rm -rf {part}; mkdir -p $(dirname {src}); "
        # dumb-HTTP mirrors cannot serve shallow clones: fall back to a full one
        f"{clone} --depth 1 {url} {part} 2>/dev/null || {clone} {url} {part}; "
        f"test \"$(git -C {part} rev-parse HEAD)\" = \"$(git -C {part} rev-parse {shlex.quote('refs/tags/' + art.ref + '^{commit}')})\"; "
        f"rm -rf {src}; mv {part} {src}"
    ))


@operation()
def verl_patch(settings: LabSettings, patch: str):
    """Apply one version-pinned patch to verl_src, idempotently (reverse-check first)."""
    art = settings.catalog.artifact("verl")
    have = host.get_fact(VerlCheckout, path=settings.verl_src, ref=art.ref, patches=[patch])
    name = patch.rsplit("/", 1)[-1]
    if have and have["patches"].get(name) == "applied":
        host.noop(f"{name} already applied")
        return
    s, p = shlex.quote(settings.verl_src), shlex.quote(patch)
    yield StringCommand("sh", "-c", shlex.quote(
        f"cd {s} && if git apply --reverse --check {p} 2>/dev/null; then echo already applied; "
        f"elif git apply --check {p}; then git apply {p}; "
        f"else echo 'verl-lab: {name} does not apply to {settings.verl_src}: it is not pristine verl "
        f"{art.version} (move it away and re-run)' >&2; exit 1; fi"
    ))


@deploy("verl source (pinned tag, version-pinned patches)")
def verl_source(settings: LabSettings):
    art = settings.catalog.artifact("verl")
    patches = patch_files(art.version)
    box_paths = box_patch_paths(settings, art.version)
    files.directory(name="Directory for verl patches", path=box_paths[0].rsplit("/", 1)[0], mode="755")
    for local, remote in zip(patches, box_paths):
        files.put(name=f"Patch {local.name}", src=str(local), dest=remote, mode="644")
    verl_clone(name=f"verl {art.ref} at {settings.verl_src}", settings=settings)
    for remote in box_paths:
        verl_patch(name=f"Apply {remote.rsplit('/', 1)[-1]}", settings=settings, patch=remote)
