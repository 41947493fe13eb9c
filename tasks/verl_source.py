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
