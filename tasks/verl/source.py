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

from tasks.facts.env import VerlCheckout  # noqa: E402
from tasks.placed import Wanted, wanted_dir, wanted_file  # noqa: E402
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


def patch_wanted(settings: LabSettings) -> list[Wanted]:
    """The patch folder and the patch files on the box (for tasks.placed.place)."""
    art = settings.catalog.artifact("verl")
    box_paths = box_patch_paths(settings, art.version)
    return [wanted_dir(box_paths[0].rsplit("/", 1)[0], "Directory for verl patches"),
            *(wanted_file(remote, f"Patch {local.name}", local.read_bytes())
              for local, remote in zip(patch_files(art.version), box_paths, strict=True))]


def checkout_done(settings: LabSettings, checkout: dict | None) -> bool:
    """The VerlCheckout answer (asked with every box patch path) shows the tag and every patch applied."""
    names = [p.rsplit("/", 1)[-1] for p in box_patch_paths(settings, settings.catalog.artifact("verl").version)]
    return bool(checkout) and checkout["at_ref"] and all(checkout["patches"].get(n) == "applied" for n in names)


@deploy("verl source (pinned tag, version-pinned patches)")
def verl_source(settings: LabSettings, done: bool = False):
    """Clone at the tag and apply the patches (placed before, by the env stage).

    ``done``: the env stage found the clone at the tag with every patch applied, and the box's
    patch files already as wanted (``checkout_done``). Else each operation reads the checkout
    when it runs, after the new patch files are in place.
    """
    art = settings.catalog.artifact("verl")
    box_paths = box_patch_paths(settings, art.version)
    if done:
        host.noop(f"verl {art.ref} at {settings.verl_src}, {len(box_paths)} patches applied")
        return
    verl_clone(name=f"verl {art.ref} at {settings.verl_src}", settings=settings)
    for remote in box_paths:
        verl_patch(name=f"Apply {remote.rsplit('/', 1)[-1]}", settings=settings, patch=remote)
