"""Stage 0: the box-side layout every later stage writes into, and the training user."""

from __future__ import annotations

from pyinfra.api import deploy
from pyinfra.operations import files, server

from tasks.settings import LabSettings


@deploy("verl-lab base layout")
def base_layout(settings: LabSettings):
    """Create lab_root with its markers/ and cache/ folders, and the unprivileged training user."""
    server.user(
        name=f"Training user {settings.train_user} (unprivileged)",
        user=settings.train_user,
        system=True,
        shell="/usr/sbin/nologin",
        home=f"{settings.lab_root}/home",
        create_home=True,
    )
    for path, mode in (
        (settings.lab_root, "755"),
        (settings.marker_dir, "755"),
        (settings.box_cache, "750"),
    ):
        files.directory(name=f"Directory {path}", path=path, mode=mode, user="root", group="root")
