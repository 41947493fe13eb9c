"""The ``tracking`` setting: which of verl 0.5.0's trackers a box's run logs to, and how (pure).

verl 0.5.0 logs through ``verl/utils/tracking.py``'s ``Tracking``: ``trainer.logger`` names the backends,
``trainer.project_name`` and ``trainer.experiment_name`` name the run, and every backend reads the rest from
the process environment (read in the release):

* tensorboard: ``TENSORBOARD_DIR`` (else ``tensorboard_log/<project>/<experiment>`` under the working
  directory), written by ``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package;
* wandb: ``wandb.init(project, name, config)``; the package itself reads ``WANDB_API_KEY``, ``WANDB_MODE``,
  ``WANDB_DIR`` from the environment;
* swanlab: ``SWANLAB_API_KEY`` (then ``swanlab.login``), ``SWANLAB_LOG_DIR`` (default ``swanlog``),
  ``SWANLAB_MODE`` (default ``cloud``; swanlab 0.6.8 also takes ``local``, ``offline``, ``disabled``);
* mlflow: ``MLFLOW_TRACKING_URI`` (default ``sqlite:////tmp/mlruns.db``: lost under the unit's PrivateTmp).

This module turns the setting into those values: the ``trainer.logger`` list, the folders under
``lab_root``, the environment (non-secret: the unit's ``train.env``; the keys: a file of their own,
readable by the train user alone), and checks it before anything changes. A box without internet (the
settings' ``artifact_mode = "relay"`` unless ``tracking.internet`` says otherwise) logs offline; the
controller syncs those runs afterwards (tasks/tracking/sync.py).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# verl 0.5.0's Tracking.supported_backend, and what verl-lab sets up of them
VERL_BACKENDS = ("wandb", "mlflow", "swanlab", "vemlp_wandb", "tensorboard", "console", "clearml")
TRACKERS = ("tensorboard", "wandb", "swanlab", "mlflow")     # console is always on: the journal is read from it
REMOTE = ("wandb", "swanlab", "mlflow")                      # they have a server; online or offline
MODES = ("auto", "online", "offline")
# the secrets each tracker reads from its environment; the keys file may hold only these
KEY_VARS: dict[str, tuple[str, ...]] = {
    "wandb": ("WANDB_API_KEY",),
    "swanlab": ("SWANLAB_API_KEY",),
    "mlflow": ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"),
}
# the key an online run cannot start without (mlflow: a server may need none)
REQUIRED_KEY = {"wandb": "WANDB_API_KEY", "swanlab": "SWANLAB_API_KEY"}
# where each tracker's package comes from in the env: wandb is verl 0.5.0's own dependency and tensorboard
# is pinned beside it (files/requirements/verl-0.5.0.txt); these two are not installed by verl-lab
EXTRA_PACKAGES = {"swanlab": "swanlab==0.6.8", "mlflow": "mlflow-skinny==3.1.4"}
TENSORBOARD_PORT = 6006

DEFAULTS: dict[str, Any] = {
    "trackers": ["tensorboard"],   # besides console
    "project": "verl-lab",         # trainer.project_name: wandb's / SwanLab's project, MLflow's experiment
    "run_name": None,              # trainer.experiment_name; None: <host>-<model>-gsm8k-<ppo|grpo>
    "mode": "auto",                # auto: online where the box has internet, else offline
    "internet": None,              # None: the box has internet only with artifact_mode = "direct"
    "keys_file": None,             # a file on the controller: KEY=value lines (KEY_VARS)
    "mlflow_uri": None,            # an online MLflow server (offline: a file store under lab_root)
    "wandb_base_url": None,        # a self-hosted wandb server (WANDB_BASE_URL), also the one synced to
    "hub": None,                   # the box serving the lab's TensorBoard; None: the inventory's first box
    "port": TENSORBOARD_PORT,      # TensorBoard's port on the hub
    "bind": "127.0.0.1",           # TensorBoard's address on the hub: localhost, reached by an SSH tunnel
}
EXAMPLE = "tracking = {'trackers': ['tensorboard', 'wandb'], 'keys_file': '~/.config/verl-lab/trackers.env'}"


class TrackingProblems(ValueError):
    """The setting's problems: ``found`` lists (key, problem, fix), the key under ``tracking``."""

    def __init__(self, found: list[tuple[str, str, str]]):
        self.found = found
        super().__init__("; ".join(f"{k}: {p}" for k, p, _ in found))


@dataclass(frozen=True)
class Tracking:
    trackers: tuple[str, ...] = ("tensorboard",)
    project: str = "verl-lab"
    run_name: str | None = None
    online: bool = False
    keys_file: Path | None = None
    mlflow_uri: str | None = None
    wandb_base_url: str | None = None
    hub: str | None = None
    port: int = TENSORBOARD_PORT
    bind: str = "127.0.0.1"
    key_names: tuple[str, ...] = field(default=(), compare=False)   # the names the keys file holds

    @property
    def logger(self) -> list[str]:
        """``trainer.logger``: console first (the journal is what the lab's status reads)."""
        return ["console", *self.trackers]

    @property
    def remote(self) -> tuple[str, ...]:
        return tuple(t for t in self.trackers if t in REMOTE)

    @property
    def offline(self) -> tuple[str, ...]:
        """The trackers whose runs stay on the box until the controller syncs them."""
        return () if self.online else self.remote

    def folders(self, lab_root: str) -> dict[str, str]:
        """Each tracker's folder under lab_root (the train user's; the unit may write there)."""
        root = f"{lab_root}/tracking"
        names = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlog", "mlflow": "mlruns"}
        return {t: f"{root}/{names[t]}" for t in self.trackers}

    def environment(self, lab_root: str, run_name: str) -> dict[str, str]:
        """What verl's trackers read from the process environment (no secret: train.env)."""
        env: dict[str, str] = {}
        folders = self.folders(lab_root)
        if "tensorboard" in folders:
            env["TENSORBOARD_DIR"] = f"{folders['tensorboard']}/{run_name}"
        if "wandb" in folders:
            env["WANDB_MODE"] = "online" if self.online else "offline"
            env["WANDB_DIR"] = folders["wandb"]          # runs go to $WANDB_DIR/wandb/<run>
            env["WANDB_CONFIG_DIR"] = f"{folders['wandb']}/config"
            env["WANDB_CACHE_DIR"] = f"{folders['wandb']}/cache"
            # verl 0.5.0 calls wandb.init(project, name, config): each start of the unit (a restart resuming
            # from a save) is a wandb run of its own, of the same name; the group keeps them together
            env["WANDB_RUN_GROUP"] = run_name
            if self.wandb_base_url:
                env["WANDB_BASE_URL"] = self.wandb_base_url
        if "swanlab" in folders:
            env["SWANLAB_MODE"] = "cloud" if self.online else "offline"
            env["SWANLAB_LOG_DIR"] = folders["swanlab"]
            env["SWANLAB_SAVE_DIR"] = f"{folders['swanlab']}/.swanlab"   # login file, not in $HOME
        if "mlflow" in folders:
            env["MLFLOW_TRACKING_URI"] = self.mlflow_uri if self.online else f"file://{folders['mlflow']}"
        return env

    def keys_on_box(self, keys: Mapping[str, str]) -> dict[str, str]:
        """Of ``keys``, those the chosen trackers read (only an online run gets them: tasks/tracking/train.py;
        offline runs are synced by the controller with the keys that stay there)."""
        return {name: keys[name] for t in self.remote for name in KEY_VARS[t] if name in keys}


def read_keys(path: Path) -> dict[str, str]:
    """The keys file: ``NAME=value`` lines (``#`` comments, blank lines); values are never printed."""
    keys: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name, value = name.strip().removeprefix("export ").strip(), value.strip().strip("'\"")
        if not sep or not value:
            raise TrackingProblems([("keys_file", f"{path}: line {number} is not NAME=value",
                                     "write one NAME=value a line, e.g. WANDB_API_KEY=...")])
        keys[name] = value
    return keys


def _words(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def check_tracking(value: Any, artifact_mode: str) -> Tracking:
    """The checked setting, or ``TrackingProblems`` listing every problem (key, problem, fix)."""
    found: list[tuple[str, str, str]] = []
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise TrackingProblems([("", f"{value!r} is not a mapping", f"set e.g. {EXAMPLE}")])
    for key in value:
        if key not in DEFAULTS:
            found.append((key, "is not a tracking key", f"use one of {', '.join(DEFAULTS)}"))
    v = {**DEFAULTS, **value}
    trackers = _words(v["trackers"])
    if trackers is None:
        found.append(("trackers", f"{v['trackers']!r} is not a list of names", f"set e.g. {EXAMPLE}"))
        trackers = []
    picked: list[str] = []
    for name in trackers:
        if name == "console":
            continue        # always on
        if name in TRACKERS:
            picked.append(name) if name not in picked else None
        elif name in VERL_BACKENDS:
            found.append(("trackers", f"{name!r} is one of verl 0.5.0's backends that verl-lab does not set up",
                          f"use {', '.join(TRACKERS)}"))
        else:
            found.append(("trackers", f"{name!r} is not a tracker verl 0.5.0 knows "
                                      f"(verl/utils/tracking.py: {', '.join(VERL_BACKENDS)})",
                          f"use {', '.join(TRACKERS)}"))
    for key in ("project", "run_name"):
        text = v[key]
        if text is not None and (not isinstance(text, str) or not text or any(c in text for c in " /\n\t'\"=")):
            found.append((key, f"{text!r} is not a name (no spaces, quotes, '/' or '=')", f"set e.g. {key} = 'gsm8k-ppo'"))
    internet = v["internet"]
    if internet is None:
        internet = artifact_mode == "direct"
    elif not isinstance(internet, bool):
        found.append(("internet", f"{internet!r} is not True/False/None", "set internet = True when the box reaches "
                                                                           "the trackers' servers"))
        internet = False
    mode = v["mode"]
    if mode not in MODES:
        found.append(("mode", f"{mode!r} is not one of {', '.join(MODES)}", "set mode = 'auto'"))
        mode = "auto"
    remote = [t for t in picked if t in REMOTE]
    if mode == "online" and remote and not internet:
        found.append(("mode", f"'online' for {', '.join(remote)}, but this box has no internet "
                              f"(artifact_mode = {artifact_mode!r}" + (", tracking.internet = False)" if v["internet"]
                                                                        is False else ")"),
                      "set mode = 'offline' (the controller syncs the runs: deploy/tracking.py), or "
                      "tracking.internet = True if the box reaches the tracker's server"))
    online = bool(remote) and (mode == "online" or (mode == "auto" and internet))
    keys_file, key_names, unread = None, (), False
    if v["keys_file"] is not None:
        keys_file = Path(os.path.expanduser(str(v["keys_file"])))
        if not keys_file.is_file():
            found.append(("keys_file", f"file {v['keys_file']!r} does not exist on the controller",
                          "write the keys as NAME=value lines to a file only you can read (chmod 600) and name it here"))
            keys_file, unread = None, True
        elif keys_file.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            found.append(("keys_file", f"{v['keys_file']!r} can be read by others "
                                       f"(mode {stat.S_IMODE(keys_file.stat().st_mode):o})", f"chmod 600 {keys_file}"))
            unread = True       # not read: what it holds is not judged until it is the owner's alone
        else:
            try:
                names = read_keys(keys_file)
            except TrackingProblems as exc:
                found += exc.found
                names, unread = {}, True
            known = {n for t in KEY_VARS.values() for n in t}
            for name in names:
                if name not in known:
                    found.append(("keys_file", f"{keys_file}: {name!r} is not a key any tracker reads",
                                  f"use {', '.join(sorted(known))}"))
            key_names = tuple(sorted(names))
    for tracker in remote:
        need = REQUIRED_KEY.get(tracker)
        if need and need not in key_names and not unread:     # a file that could not be read: said above
            where = "the box's online run" if online else "the controller's sync"
            found.append(("keys_file", f"{tracker} needs {need} for {where}, and "
                                       + (f"{v['keys_file']!r} has none" if keys_file else "no keys_file is set"),
                          f"add {need}=... to a keys file (chmod 600) named by tracking.keys_file"))
    if "mlflow" in picked and online and not v["mlflow_uri"]:
        found.append(("mlflow_uri", "an online MLflow run needs its server", "set mlflow_uri = 'https://mlflow.example:5000'"
                                                                             " or mode = 'offline' (a file store on the box)"))
    for key in ("mlflow_uri", "wandb_base_url"):
        if v[key] is not None and (not isinstance(v[key], str) or not v[key].startswith(("http://", "https://"))):
            found.append((key, f"{v[key]!r} is not an http(s) URL", f"set {key} = 'https://...'"))
    hub = v["hub"]
    if hub is not None and not isinstance(hub, str):
        found.append(("hub", f"{hub!r} is not a host name of the inventory", "set hub = 'box1'"))
    port = v["port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 1024 <= port <= 65535:
        found.append(("port", f"{port!r} is not a port in 1024-65535", f"set port = {TENSORBOARD_PORT}"))
    if not isinstance(v["bind"], str) or not v["bind"] or any(c in v["bind"] for c in " \n/"):
        found.append(("bind", f"{v['bind']!r} is not an address", "set bind = '127.0.0.1'"))
    if found:
        raise TrackingProblems(found)
    return Tracking(trackers=tuple(picked), project=v["project"], run_name=v["run_name"], online=online,
                    keys_file=keys_file, mlflow_uri=v["mlflow_uri"], wandb_base_url=v["wandb_base_url"], hub=hub,
                    port=port, bind=v["bind"], key_names=key_names)


def run_name(tracking: Tracking, host: str, experiment: str, algorithm: str) -> str:
    """The run's name in every tracker: the setting's, else the box, the model and the plan's algorithm."""
    return tracking.run_name or f"{host}-{experiment}-{algorithm}"
