"""Host settings: the inventory's data for one box, checked and given defaults.

Pure: takes a plain mapping (pyinfra's ``host.data`` turned into a dict) and returns a
frozen ``LabSettings`` or raises ``SettingsError`` naming the host, the key and the fix.
Every default lives here, once (a nested setting's keys: beside its checker, e.g.
``workload.WORKLOAD_DEFAULTS``); ``inventory/group_data/all.py`` only sets site choices.
The checkers of a topic live in a module of their own beside this one (tasks/settings/): ``catalog`` (catalog,
mirrors, artifact names), ``workload`` (workload, workload.model, gpu_override),
``cluster`` (the cluster setting, and ``check_clusters`` across hosts); which keys are read and
which refused (dotted keys, a nested setting's key at the top, a key nothing reads) in ``keys``;
the errors and their collector in ``errors``. This module wires them together in ``load_settings``.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.catalog import Catalog, MirrorSet, default_catalog
from tasks.settings.catalog import _artifact_name, _catalog, _mirrors

# Cluster, check_clusters and ipv4 are not used here, only re-exported: ``from tasks.settings import``
# keeps naming the settings' public face (tasks/cluster.py, tasks/hostdata.py, bench/gpu/ppo_profiles.py
# and the tests import them so), as it does the errors load_settings raises and WORKLOAD_DEFAULTS.
from tasks.settings.cluster import CLUSTER_KEYS, Cluster, _cluster, _ip_address, check_clusters, ipv4  # noqa: F401
from tasks.settings.errors import Problems, SettingsError, SettingsErrors, did_you_mean
from tasks.settings.keys import expand_dotted, nested_keys, unread_keys
from tasks.settings.workload import GPU_OVERRIDE_KEYS, WORKLOAD_DEFAULTS, _gpu_override, _workload, _workload_model
from tasks.tracking import DEFAULTS as TRACKING_DEFAULTS
from tasks.tracking import Tracking, TrackingProblems, check_tracking

ARTIFACT_MODES = ("relay", "direct")
ENV_BACKENDS = ("conda", "venv")
UNIT_STATES = ("installed", "enabled", "started", "stopped")
DRIVER_MODES = ("check", "install")
DRIVER_BUSY = ("refuse", "stop")
USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,30}$")

DEFAULTS: dict[str, Any] = {
    # where artifacts come from
    "artifact_mode": "relay",          # relay: controller downloads once, pushes; direct: box downloads
    "mirror_profile": "global",        # global | cn  (files/catalog.toml [sources])
    "mirror_urls": {},                 # source name -> base URL, replacing the profile's
    "catalog_overrides": {},           # artifact name -> {field: value}
    "controller_cache": "~/.cache/verl-lab",
    # where things go on the box
    "lab_root": "/opt/verl-lab",       # markers, box-side artifact cache, launcher, data
    "cuda_prefix": "/usr/local/cuda-11.8",
    "install_tmpdir": "/var/tmp/verl-lab",
    "allow_no_driver": False,          # install the toolkit on a box without an NVIDIA driver
    # the NVIDIA driver (tasks/driver/stage.py): check (the CUDA stage refuses one too old for CUDA 11.8) |
    # install (choose the branch from the GPUs, install it from the distro's archive, hold it, prove it)
    "driver": "check",
    "driver_reboot": False,            # driver = install: reboot a box whose new driver needs it (one at a time)
    "driver_update": False,            # driver = install: take a newer build of the held branch (idle boxes only)
    # driver = install, a driver change (install, update, reboot) while the training or Ray unit is busy:
    # refuse (changing nothing) | stop (the stage masks and stops them for the change, then unmasks them)
    "driver_busy": "refuse",
    "env_backend": "conda",            # conda | venv
    "env_prefix": "/opt/verl-lab/envs/verl",
    "conda_prefix": "/opt/verl-lab/miniforge3",
    "venv_python": "python3",
    "env_health_check": "quick",       # quick | full: how a re-run re-checks a proven env         # interpreter for the venv backend (>= 3.10)
    # training
    "train_user": "verl",
    "train_unit_state": "enabled",     # installed | enabled | started | stopped (tasks/train.py)
    "hf_token_file": None,             # a file on the controller holding an HF token
    "model_artifact": "qwen_model",
    "dataset_artifact": "gsm8k",
    "train_steps": None,               # a step cap (a smoke test: e.g. 20); None: workload.epochs over GSM8K
    # the longest run the checks let start: a plan whose speed-model step time makes the run longer is refused,
    # with the faster plan (tasks/run_bounds.py)
    "max_run_days": 7,
    # what to train (checked by _workload; the plan: tasks/plan/, docs/plan.md)
    "workload": {},
    # plan for this GPU instead of the box's own (a build box without a GPU, or a box whose
    # nvidia-smi cannot tell): {"name": "Tesla T4", "compute_capability": "7.5",
    # "memory_mib": 15360, "count": 1}
    "gpu_override": None,
    "launcher_python": "/usr/bin/python3",   # runs the training launcher (stdlib only)
    # boxes that train together as one Ray cluster (tasks/cluster.py): {"name": "lab1", "head": "box1",
    # "port": 6379}, the same value on every member (e.g. in the group's group_data); None: trains alone
    "cluster": None,
    "cluster_address": None,           # this box's IPv4 address on the cluster network (the head needs one)
    # checkpoint saves (checked by _checkpoints; tasks/checkpoints.py): {"keep": whole saves kept at
    # any time, also while the next is written, "every": steps between saves}
    "checkpoints": {},
    # verl's trackers (trainer.logger) and the lab's TensorBoard (tasks/tracking/setting.py, docs/tracking.md):
    # {"trackers": [...], "keys_file": ..., "mode": "auto"|"online"|"offline", "hub": "box1", ...}
    "tracking": {},
}

KNOWN_KEYS = set(DEFAULTS)
CHECKPOINT_DEFAULTS: dict[str, int] = {"keep": 1, "every": 10}

# the nested settings and the keys each knows: a dotted key sets one of them (``workload.model``), a top-level
# key that names one is refused with the dotted form (tasks/settings/keys.py)
NESTED = nested_keys(DEFAULTS, {"workload": WORKLOAD_DEFAULTS, "checkpoints": CHECKPOINT_DEFAULTS,
                                "tracking": TRACKING_DEFAULTS, "cluster": CLUSTER_KEYS,
                                "gpu_override": GPU_OVERRIDE_KEYS})


def host_keys(host: str, data: Mapping[str, Any]) -> tuple[dict[str, Any], list[SettingsError]]:
    """A host's data with its dotted keys set inside their settings, and every key nothing would read
    (tasks/settings/keys.py: pyinfra's, another deploy's and the site's ``site_*`` keys pass)."""
    expanded, problems = expand_dotted(host, data, NESTED)
    return expanded, problems + unread_keys(host, expanded, KNOWN_KEYS, NESTED)

# The systemd unit that runs training on every box (files/templates/verl-lab-train.service.j2), and
# the one that runs a cluster member's Ray node (files/templates/verl-lab-ray.service.j2).
TRAIN_UNIT = "verl-lab-train.service"
RAY_UNIT = "verl-lab-ray.service"
LEGACY_STAGE_NAMES = {"env": "pyenv"}     # stage -> the marker name it had before


@dataclass(frozen=True)
class LabSettings:
    host: str
    artifact_mode: str
    mirror_profile: str
    mirrors: MirrorSet
    catalog: Catalog
    controller_cache: Path
    lab_root: str
    cuda_prefix: str
    install_tmpdir: str
    allow_no_driver: bool
    env_backend: str
    env_health_check: str
    env_prefix: str
    conda_prefix: str
    venv_python: str
    train_user: str
    train_unit_state: str
    hf_token_file: Path | None
    model_artifact: str
    dataset_artifact: str
    train_steps: int | None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)
    gpu_override: Mapping[str, Any] | None = None
    launcher_python: str = "/usr/bin/python3"
    workload: Mapping[str, Any] = field(default_factory=lambda: dict(WORKLOAD_DEFAULTS))
    cluster: Mapping[str, Any] | None = None
    cluster_address: str | None = None
    driver: str = "check"
    driver_reboot: bool = False
    driver_update: bool = False
    driver_busy: str = "refuse"
    checkpoints: Mapping[str, int] = field(default_factory=lambda: dict(CHECKPOINT_DEFAULTS))
    tracking: Tracking = field(default_factory=Tracking)
    max_run_days: float = 7

    @property
    def marker_dir(self) -> str:
        return f"{self.lab_root}/markers"

    @property
    def box_cache(self) -> str:
        return f"{self.lab_root}/cache"

    def marker(self, stage: str) -> str:
        """A stage's marker: written only after the stage's proofs pass (key=value lines)."""
        return f"{self.marker_dir}/{stage}.done"

    def legacy_marker(self, stage: str) -> str | None:
        """The marker a stage wrote under its old name (the env stage was "pyenv"): read when
        the marker is missing, so an upgraded box keeps its proven env; the stage's next write
        replaces it."""
        old = LEGACY_STAGE_NAMES.get(stage)
        return f"{self.marker_dir}/{old}.done" if old else None

    @property
    def env_python(self) -> str:
        return f"{self.env_prefix}/bin/python"

    @property
    def model_dir(self) -> str:
        repo = self.catalog.artifact(self.model_artifact).repo or self.model_artifact
        return f"{self.lab_root}/models/{repo.replace('/', '--')}"

    @property
    def data_dir(self) -> str:
        return f"{self.lab_root}/data/{self.dataset_artifact}"

    @property
    def verl_src(self) -> str:
        return f"{self.lab_root}/src/verl"

    @property
    def train_dir(self) -> str:
        """Launcher, EnvironmentFile, plan.json; checkpoints go under train_dir/checkpoints."""
        return f"{self.lab_root}/train"

    def url(self, artifact_name: str) -> str:
        return self.catalog.artifact(artifact_name).url(self.mirrors)


# ------------------------------------------------------------------ the checkers
# Each takes the host and the value(s) it checks, returns the value to keep, and raises
# SettingsError (SettingsErrors for several problems) naming the key, the value and the fix.
# A new setting: its default in DEFAULTS, a checker here (or in the folder's module of its
# topic), one ``p.check`` line in load_settings, a field of LabSettings.


def _abs_path(host: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\n" in value or " " in value:
        raise SettingsError(host, key, f"{value!r} is not an absolute path without spaces",
                            f"set {key} to an absolute path such as {DEFAULTS[key]!r}")
    return value.rstrip("/") or "/"


def _choice(host: str, key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise SettingsError(host, key, f"{value!r} is not one of {', '.join(allowed)}",
                            f"{did_you_mean(value, allowed)}set {key} to one of {', '.join(allowed)} in the "
                            "inventory or group_data")
    return value


def _checkpoints(host: str, value: Any) -> dict[str, int]:
    """checkpoints: how many whole saves are kept and how often one is made (positive integers)."""
    if not isinstance(value, Mapping):
        raise SettingsError(host, "checkpoints", f"{value!r} is not a mapping",
                            "use e.g. checkpoints = {'keep': 2, 'every': 20}")
    found = [SettingsError(host, f"checkpoints.{key}", "not a checkpoints key",
                           f"did you mean checkpoints.{close[0]}?" if close else "use keep and every")
             for key in value if key not in CHECKPOINT_DEFAULTS
             for close in [difflib.get_close_matches(str(key), sorted(CHECKPOINT_DEFAULTS), n=1, cutoff=0.6)]]
    merged = {**CHECKPOINT_DEFAULTS, **{k: v for k, v in value.items() if k in CHECKPOINT_DEFAULTS}}
    meaning = {"keep": "whole saves kept at any time (1: the last whole save stays while the next is written)",
               "every": "steps between saves (verl also saves at the last step)"}
    found += [SettingsError(host, f"checkpoints.{key}", f"{merged[key]!r} is not a positive integer",
                            f"set it to a positive integer, {meaning[key]} (default {default})")
              for key, default in CHECKPOINT_DEFAULTS.items()
              if not isinstance(merged[key], int) or isinstance(merged[key], bool) or merged[key] < 1]
    if found:
        raise SettingsErrors(found)
    return merged


def _ssh_key(host: str, key_file: Any) -> None:
    """pyinfra's own SSH key setting: a missing key file would fail later, per connection."""
    if key_file and not Path(os.path.expanduser(str(key_file))).is_file():
        raise SettingsError(host, "ssh_key", f"file {key_file!r} does not exist",
                            "point ssh_key at a private key file on the controller, or remove it to use ssh-agent")


def _train_user(host: str, user: Any) -> str:
    if not isinstance(user, str) or not USER_RE.match(user) or user == "root":
        raise SettingsError(host, "train_user", f"{user!r} is not a valid unprivileged user name",
                            "use a lowercase name such as 'verl' (training never runs as root)")
    return user


def _token_file(host: str, token_file: Any) -> Path | None:
    if token_file is None:
        return None
    token_path = Path(os.path.expanduser(str(token_file)))
    if not token_path.is_file():
        raise SettingsError(host, "hf_token_file", f"file {token_file!r} does not exist",
                            "write the token to a file readable only by you (chmod 600) and name it here")
    return token_path


def _train_steps(host: str, steps: Any) -> int | None:
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise SettingsError(host, "train_steps", f"{steps!r} is not a positive integer",
                            "set e.g. train_steps = 20 (a smoke test), or leave it unset to train workload.epochs")
    return steps

def _max_run_days(host: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise SettingsError(host, "max_run_days", f"{value!r} is not a positive number of days",
                            "set e.g. max_run_days = 14 (the default 7: a week)")
    return value


def _driver_flag(host: str, key: str, value: Any, driver: str) -> bool:
    if _flag(host, key, value) and driver != "install":
        raise SettingsError(host, key, f"True does nothing with driver = {driver!r}",
                            f"set driver = 'install' as well, or leave {key} out")
    return value


def _driver_busy(host: str, value: Any, driver: str) -> str:
    choice = _choice(host, "driver_busy", value, DRIVER_BUSY)
    if choice != "refuse" and driver != "install":
        raise SettingsError(host, "driver_busy", f"{value!r} does nothing with driver = {driver!r}",
                            "set driver = 'install' as well, or leave driver_busy out")
    return choice


def _tracking(host: str, value: Any, artifact_mode: str) -> Tracking:
    try:
        return check_tracking(value, artifact_mode)
    except TrackingProblems as exc:
        raise SettingsErrors([SettingsError(host, f"tracking.{k}" if k else "tracking", p, f)
                              for k, p, f in exc.found]) from None


def _flag(host: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SettingsError(host, key, f"{value!r} is not True/False", f"set {key} = True or False")
    return value


def load_settings(host: str, data: Mapping[str, Any], catalog: Catalog | None = None) -> LabSettings:
    """Check one host's data and return its settings; raise ``SettingsErrors`` listing every
    problem of it (each a ``SettingsError``: host, key, value, fix), not only the first."""
    p = Problems(host)
    data, unread = host_keys(host, data)
    p.found += unread
    merged = {**DEFAULTS, **{k: v for k, v in data.items() if k in KNOWN_KEYS}}
    base = catalog or default_catalog()
    cat = p.check(_catalog, base, merged["catalog_overrides"], default=base)
    workload = p.check(_workload, merged["workload"], default=dict(WORKLOAD_DEFAULTS))
    model_artifact = p.check(_artifact_name, cat, "model_artifact", merged["model_artifact"],
                             default=DEFAULTS["model_artifact"])
    settings = LabSettings(
        host=host,
        artifact_mode=p.check(_choice, "artifact_mode", merged["artifact_mode"], ARTIFACT_MODES),
        mirror_profile=merged["mirror_profile"],
        mirrors=p.check(_mirrors, cat, merged["mirror_profile"], merged["mirror_urls"]),
        catalog=cat,
        controller_cache=Path(os.path.expanduser(str(merged["controller_cache"]))),
        lab_root=p.check(_abs_path, "lab_root", merged["lab_root"]),
        cuda_prefix=p.check(_abs_path, "cuda_prefix", merged["cuda_prefix"]),
        install_tmpdir=p.check(_abs_path, "install_tmpdir", merged["install_tmpdir"]),
        allow_no_driver=p.check(_flag, "allow_no_driver", merged["allow_no_driver"]),
        env_backend=p.check(_choice, "env_backend", merged["env_backend"], ENV_BACKENDS),
        env_health_check=p.check(_choice, "env_health_check", merged["env_health_check"], ("quick", "full")),
        env_prefix=p.check(_abs_path, "env_prefix", merged["env_prefix"]),
        conda_prefix=p.check(_abs_path, "conda_prefix", merged["conda_prefix"]),
        venv_python=str(merged["venv_python"]),
        train_user=p.check(_train_user, merged["train_user"]),
        train_unit_state=p.check(_choice, "train_unit_state", merged["train_unit_state"], UNIT_STATES),
        hf_token_file=p.check(_token_file, merged["hf_token_file"]),
        model_artifact=p.check(_workload_model, cat, workload["model"], model_artifact, "model_artifact" in data,
                               default=model_artifact),
        dataset_artifact=p.check(_artifact_name, cat, "dataset_artifact", merged["dataset_artifact"]),
        train_steps=p.check(_train_steps, merged["train_steps"]),
        raw=dict(data),
        gpu_override=p.check(_gpu_override, merged["gpu_override"]),
        launcher_python=p.check(_abs_path, "launcher_python", merged["launcher_python"]),
        workload=workload,
        cluster=p.check(_cluster, merged["cluster"]),
        cluster_address=p.check(_ip_address, "cluster_address", merged["cluster_address"]),
        driver=p.check(_choice, "driver", merged["driver"], DRIVER_MODES, default="check"),
        driver_reboot=p.check(_driver_flag, "driver_reboot", merged["driver_reboot"], merged["driver"], default=False),
        driver_update=p.check(_driver_flag, "driver_update", merged["driver_update"], merged["driver"], default=False),
        driver_busy=p.check(_driver_busy, merged["driver_busy"], merged["driver"], default="refuse"),
        checkpoints=p.check(_checkpoints, merged["checkpoints"], default=dict(CHECKPOINT_DEFAULTS)),
        tracking=p.check(_tracking, merged["tracking"], merged["artifact_mode"], default=Tracking()),
        max_run_days=p.check(_max_run_days, merged["max_run_days"], default=DEFAULTS["max_run_days"]),
    )
    p.check(_ssh_key, data.get("ssh_key"))
    p.raise_any()
    return settings
