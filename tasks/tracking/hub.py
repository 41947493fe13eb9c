"""The lab's TensorBoard: one box (the hub) serves every box's training curves (deploy/tracking.py).

Why one box and the controller as the channel: the boxes of a relay lab reach nothing but the controller
(and the controller reaches them over SSH), so the event files travel the way the relay's downloads do,
through the controller: each box's ``<lab_root>/tracking/tensorboard`` is copied into the controller cache
(``<controller_cache>/tracking/lab/<box>/``), and the cache onto the hub's served copy
``<lab_root>/tracking-lab`` (root's, under root-owned parents: the train user reads it and can change
nothing in it), which ``verl-lab-tensorboard.service`` serves (TensorBoard from the env, as the train user,
on 127.0.0.1 by default: reached with the SSH tunnel deploy/status.py prints). Both legs append only the
bytes a file gained (tasks/tracking/copy.py). A box that goes away keeps its curves: the cache and the hub
keep what was copied; nothing is deleted for a box that did not answer. A new hub gets everything back
from the cache on its first run. The lab's own scalars (the GSM8K base -> trained scores, the plan's
predicted peak) go beside verl's as a run of their own per box, ``<box>/verl-lab`` (tasks/tracking/events.py).

Pure parts first (paths, the summary file, the tunnel), then the ``@deploy``.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from pyinfra.api import deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.operations import python, server, systemd

from tasks.catalog import REPO_ROOT
from tasks.placed import place, rendered, wanted_dir, wanted_file
from tasks.settings import LabSettings
from tasks.tracking.copy import push
from tasks.tracking.events import summary_digest, summary_events, summary_file_name

HUB_UNIT = "verl-lab-tensorboard.service"
UNIT_PATH = f"/etc/systemd/system/{HUB_UNIT}"
UNIT_TEMPLATE = REPO_ROOT / "files" / "templates" / "verl-lab-tensorboard.service.j2"
SUMMARY_RUN = "verl-lab"           # <box>/verl-lab: the lab's own scalars
START_WAIT_S = 90


class HubNotProvisioned(PyinfraError):
    """deploy/tracking.py's hub cannot serve (no train user, no TensorBoard in its env): the run stops before any
    box changes; pyinfra prints the message once, as one line."""


def hub_name(settings: LabSettings, hosts: list[str]) -> str:
    """The box serving the lab's TensorBoard: ``tracking.hub``, else the inventory's first box."""
    return settings.tracking.hub or hosts[0]


def box_events_dir(settings: LabSettings) -> str:
    return f"{settings.lab_root}/tracking/tensorboard"


def served_dir(settings: LabSettings) -> str:
    """Root's (0750, the train user's group reads), beside ``<lab_root>/tracking`` and not inside it: no
    parent the train user can write, in no ``ReadWritePaths`` of the training unit."""
    return f"{settings.lab_root}/tracking-lab"


def cache_dir(settings: LabSettings) -> Path:
    return settings.controller_cache / "tracking" / "lab"


def write_summary(cache: Path, host: str, summary: dict, now: float | None = None) -> Path | None:
    """At prepare time, on the controller: the box's summary event file in the cache, rewritten only when
    what it says changed (the older file goes, so the hub drops it too). None: nothing to say yet."""
    folder = cache / host / SUMMARY_RUN
    digest = summary_digest(summary)
    existing = sorted(folder.glob("events.out.tfevents.*")) if folder.is_dir() else []
    if any(p.name.endswith(f".{digest}") for p in existing):
        return next(p for p in existing if p.name.endswith(f".{digest}"))
    g = summary.get("gsm8k") or {}
    if g.get("base") is None and g.get("trained") is None and summary.get("predicted_peak_mib") is None:
        return None
    now = time.time() if now is None else now
    folder.mkdir(parents=True, exist_ok=True)
    for old in existing:
        old.unlink()
    path = folder / summary_file_name(host, summary, now)
    path.write_bytes(summary_events(host, summary, now))
    return path


def tunnel_command(hub: str, ssh: dict, port: int, bind: str) -> str:
    """The SSH tunnel from the controller to the hub's TensorBoard (``ssh``: the hub's pyinfra ssh_* data)."""
    target = ssh.get("ssh_hostname") or hub
    if ssh.get("ssh_user"):
        target = f"{ssh['ssh_user']}@{target}"
    opts = []
    if ssh.get("ssh_port"):
        opts.append(f"-p {ssh['ssh_port']}")
    if ssh.get("ssh_key"):
        opts.append(f"-i {shlex.quote(str(ssh['ssh_key']))}")
    if ssh.get("ssh_known_hosts_file"):
        opts.append(f"-o UserKnownHostsFile={shlex.quote(str(ssh['ssh_known_hosts_file']))}")
    remote = "127.0.0.1" if bind in ("0.0.0.0", "::") else bind
    return " ".join(["ssh", "-N", "-L", f"{port}:{remote}:{port}", *opts, target])


def shares_loopback(ssh: dict) -> bool:
    """Whether the controller reaches the hub at a loopback address (``ssh_hostname``: the lab in a box, whose
    boxes share this machine's network; or an SSH port forward, which ``served_here`` tells apart)."""
    import ipaddress

    name = str(ssh.get("ssh_hostname") or "")
    try:
        return name == "localhost" or ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def served_here(port: int, logdir: str, timeout: float = 2.0) -> bool:
    """Whether a TensorBoard serving ``logdir`` (the hub's served copy) answers on this machine's 127.0.0.1:``port``
    (its ``/data/logdir``): the hub shares this machine's loopback, so the page opens with no tunnel."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/logdir", timeout=timeout) as answer:
            return json.loads(answer.read()).get("logdir") == logdir
    except (OSError, ValueError, AttributeError):
        return False


def hub_words(settings: LabSettings, inventory, serving: bool | None = None, here: bool = False) -> str:
    """deploy/status.py's line: where the lab's TensorBoard is and how to open it. ``serving``: whether the hub's
    unit is active (None: the hub was not asked, e.g. left out by --limit); ``here``: the controller reaches it on
    its own loopback (``served_here``). The SSH tunnel only to a serving hub, and not where none is needed."""
    if "tensorboard" not in settings.tracking.trackers:
        return "The lab's TensorBoard: off (settings tracking.trackers has no 'tensorboard')"
    names = [h.name for h in inventory]
    hub = hub_name(settings, names)
    if hub not in names:
        return f"The lab's TensorBoard: tracking.hub = {hub!r} is not a box of this inventory"
    port = settings.tracking.port
    if serving is False:
        return (f"The lab's TensorBoard: not serving on {hub} ({HUB_UNIT} is not running there); "
                "pyinfra -y <inventory> deploy/tracking.py copies every box's curves there and starts it")
    if serving and here:
        return (f"The lab's TensorBoard on {hub}: open http://127.0.0.1:{port}/ (no tunnel needed: this machine "
                f"shares {hub}'s loopback, as the lab in a box does)")
    data = inventory.get_host(hub).data
    ssh = {k: data.get(k) for k in ("ssh_hostname", "ssh_user", "ssh_port", "ssh_key", "ssh_known_hosts_file")}
    asked = "" if serving else f", if it serves: {hub} was not asked in this run"
    return (f"The lab's TensorBoard on {hub} (filled by deploy/tracking.py{asked}): "
            f"{tunnel_command(hub, ssh, port, settings.tracking.bind)}  then open http://localhost:{port}/")


# ------------------------------------------------------------------ the deploy


def hub_values(settings: LabSettings) -> dict:
    t = settings.tracking
    return {"user": settings.train_user, "python": settings.env_python, "logdir": served_dir(settings),
            "bind": t.bind, "port": t.port, "home": f"{settings.lab_root}/home", "unit_name": HUB_UNIT}


def hub_wanted(settings: LabSettings) -> list:
    return [wanted_dir(served_dir(settings), "The lab's TensorBoard folder (root's; read by the train user)",
                       mode="750", group=settings.train_user),
            wanted_file(UNIT_PATH, f"Unit {HUB_UNIT}", rendered(UNIT_TEMPLATE, **hub_values(settings)))]


@deploy("The lab's TensorBoard")
def install_tracking_hub(settings: LabSettings):
    """On the hub, after every box's collect: the served folder filled from the cache, the unit placed and
    running, and TensorBoard answering on its port."""
    changed = place(hub_wanted(settings))[UNIT_PATH] is not None
    if changed:
        systemd.daemon_reload(name="systemd reads the changed unit")
    python.call(name="Every box's event files onto the hub (the bytes each gained)", function=push,
                settings=settings, local_root=str(cache_dir(settings)), remote_root=served_dir(settings),
                unit=HUB_UNIT)
    systemd.service(name=f"Unit {HUB_UNIT}: enabled and running", service=HUB_UNIT, running=True, enabled=True,
                    restarted=changed)
    url = f"http://{'127.0.0.1' if settings.tracking.bind in ('0.0.0.0', '::') else settings.tracking.bind}:" \
          f"{settings.tracking.port}/data/logdir"
    server.shell(name=f"TensorBoard answers on {settings.tracking.bind}:{settings.tracking.port}",
                 commands=[f"for i in $(seq {START_WAIT_S}); do {shlex.quote(settings.launcher_python)} -c "
                           f"{shlex.quote(f'import urllib.request; urllib.request.urlopen({url!r}, timeout=5)')} "
                           f"2>/dev/null && exit 0; sleep 1; done; systemctl status --no-pager {HUB_UNIT}; exit 1"])
