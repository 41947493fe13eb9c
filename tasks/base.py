"""Stage 0: the box-side layout every later stage writes into, and the training user; and the
host's GPU target (tasks/target.py), read in the same command and returned to the stages."""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import server

from tasks.facts.bundle import ask
from tasks.facts.files import PasswdEntry, PathStates
from tasks.facts.gpu import NvidiaGpus
from tasks.placed import place, wanted_dir
from tasks.settings import LabSettings
from tasks.target import HostGpu, decide_gpu

SHELL = "/usr/sbin/nologin"


@deploy("verl-lab base layout")
def base_layout(settings: LabSettings) -> HostGpu:
    """Create lab_root with its markers/ and cache/ folders, and the unprivileged training user;
    return the host's GPU target for the stages after it.

    One command decides (the user's passwd entry, the folders' modes, the GPUs and driver): a
    re-run on a box that is as it should be issues no operation at all.
    """
    home = f"{settings.lab_root}/home"
    dirs = [wanted_dir(settings.lab_root), wanted_dir(settings.marker_dir),
            wanted_dir(settings.box_cache, mode="750")]
    states, entry, gpus = ask((PathStates, {"paths": [home] + [d.path for d in dirs]}),
                              (PasswdEntry, {"user": settings.train_user}), (NvidiaGpus, {}))
    home_state = (states or {}).get(home)
    if (entry and entry["uid"] != 0 and entry["home"] == home and entry["shell"] == SHELL
            and home_state and home_state.get("kind") == "dir" and home_state.get("user") == settings.train_user):
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
    place(dirs, states or {})
    return decide_gpu(settings, gpus)
