"""Stage 0: the box-side layout every later stage writes into, and the training user."""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import files, server

from tasks.facts.files import PasswdEntry, PathModes
from tasks.settings import LabSettings

SHELL = "/usr/sbin/nologin"


@deploy("verl-lab base layout")
def base_layout(settings: LabSettings):
    """Create lab_root with its markers/ and cache/ folders, and the unprivileged training user.

    Two facts decide (the user's passwd entry, the folders' modes): a re-run on a box that is
    as it should be issues no operation at all.
    """
    home = f"{settings.lab_root}/home"
    dirs = ((settings.lab_root, "755", "root", "root"),
            (settings.marker_dir, "755", "root", "root"),
            (settings.box_cache, "750", "root", "root"))
    modes = host.get_fact(PathModes, paths=[home] + [d[0] for d in dirs])
    entry = host.get_fact(PasswdEntry, user=settings.train_user)
    if (entry and entry["uid"] != 0 and entry["home"] == home and entry["shell"] == SHELL
            and modes.get(home) and modes[home][1] == settings.train_user):
        host.noop(f"training user {settings.train_user} exists (uid {entry['uid']}, home {home})")
    else:
        server.user(
            name=f"Training user {settings.train_user} (unprivileged)",
            user=settings.train_user,
            system=True,
            shell=SHELL,
            home=home,
            create_home=True,
        )
    for path, mode, user, group in dirs:
        if modes.get(path) == (mode, user, group):
            continue
        files.directory(name=f"Directory {path}", path=path, mode=mode, user=user, group=group)
