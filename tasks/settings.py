"""Host settings: the inventory's data for one box, checked and given defaults.

Pure: takes a plain mapping (pyinfra's ``host.data`` turned into a dict) and returns a
frozen ``LabSettings`` or raises ``SettingsError`` naming the host, the key and the fix.
Every default lives here, once; ``inventory/group_data/all.py`` only sets site choices.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tasks.facts.gpu import parse_compute_capability
from tasks.catalog import Catalog, CatalogError, MirrorSet, default_catalog
from tasks.tracking import Tracking, TrackingProblems, check_tracking

ARTIFACT_MODES = ("relay", "direct")
ENV_BACKENDS = ("conda", "venv")
UNIT_STATES = ("installed", "enabled", "started", "stopped")
DRIVER_MODES = ("check", "install")
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
    # the NVIDIA driver (tasks/driver.py): check (the CUDA stage refuses one too old for CUDA 11.8) |
    # install (choose the branch from the GPUs, install it from the distro's archive, hold it, prove it)
    "driver": "check",
    "driver_reboot": False,            # driver = install: reboot a box whose new driver needs it (one at a time)
    "driver_update": False,            # driver = install: take a newer build of the held branch (idle boxes only)
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
    # verl's trackers (trainer.logger) and the lab's TensorBoard (tasks/tracking.py, docs/tracking.md):
    # {"trackers": [...], "keys_file": ..., "mode": "auto"|"online"|"offline", "hub": "box1", ...}
    "tracking": {},
}

KNOWN_KEYS = set(DEFAULTS)
# workload keys and their defaults: verl's GSM8K quick start, one epoch, the plan's fallback ladder
WORKLOAD_DEFAULTS: dict[str, Any] = {"algorithm": "auto", "model": None, "train_batch_size": 256,
                                     "ppo_mini_batch_size": 64, "max_prompt_length": 256, "max_response_length": 256,
                                     "epochs": 1, "rollout": "auto",
                                     # LoRA (tasks/plan/lora.py, docs/plan.md "LoRA"): auto trains LoRA where full
                                     # fine-tuning needs the CPU-offload rung or does not fit, full where it fits
                                     "finetune": "auto", "lora_rank": 32, "lora_alpha": 32,
                                     "target_modules": "all-linear"}
# the keys that are not positive integers
WORKLOAD_WORDS = ("algorithm", "model", "rollout", "finetune", "target_modules")
WORKLOAD_FINETUNES = ("auto", "full", "lora")
# the linear layers of a Qwen2/Llama decoder layer that LoRA may target (PEFT's "all-linear" takes them all)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORKLOAD_ALGORITHMS = ("auto", "ppo", "grpo")   # auto: PPO, else GRPO, else GRPO with shorter responses
# auto: vLLM where the GPU runs it (compute capability >= 7.0), else the HF rollout; vllm: vLLM or
# this box fails (tasks.plan.rollout_refusal); hf: the HF-transformers rollout, and no vLLM in the env
WORKLOAD_ROLLOUTS = ("auto", "vllm", "hf")
CHECKPOINT_DEFAULTS: dict[str, int] = {"keep": 1, "every": 10}

# Host data that belongs to pyinfra (its connectors' ``ssh_*``/``docker_*``... keys, its global
# arguments ``_sudo``...) or to the site is left alone; only a near miss of a verl-lab key is an
# error, since pyinfra would silently ignore it and the default would apply.
PYINFRA_KEY_PREFIXES = ("_", "ssh_", "docker_", "podman_", "chroot_", "local_", "winrm_", "vagrant_",
                        "terraform_", "fake_")
NEAR_MISS_CUTOFF = 0.8


def near_miss(key: str) -> str | None:
    """The verl-lab key that ``key`` looks like a misspelling of, or None."""
    if key in KNOWN_KEYS or key.startswith(PYINFRA_KEY_PREFIXES):
        return None
    close = difflib.get_close_matches(key, sorted(KNOWN_KEYS), n=1, cutoff=NEAR_MISS_CUTOFF)
    return close[0] if close else None

# The systemd unit that runs training on every box (files/templates/verl-lab-train.service.j2).
TRAIN_UNIT = "verl-lab-train.service"
LEGACY_STAGE_NAMES = {"env": "pyenv"}     # stage -> the marker name it had before


class SettingsError(ValueError):
    """A bad inventory value. ``str()`` names the host, the key, the value and the fix."""

    def __init__(self, host: str, key: str, problem: str, fix: str):
        self.host, self.key, self.problem, self.fix = host, key, problem, fix
        super().__init__(f"host {host}: {key}: {problem}. Fix: {fix}")

    @property
    def problems(self) -> list["SettingsError"]:
        return [self]


class SettingsErrors(SettingsError):
    """Every problem found (of one host, or of the whole inventory), not only the first: one line
    each in ``str()``; ``problems`` lists them; host/key/problem/fix are the first one's."""

    def __init__(self, problems: list[SettingsError]):
        self._problems = [each for p in problems for each in p.problems]
        first = self._problems[0]
        self.host, self.key, self.problem, self.fix = first.host, first.key, first.problem, first.fix
        ValueError.__init__(self, "\n".join(str(p) for p in self._problems))

    @property
    def problems(self) -> list[SettingsError]:
        return list(self._problems)


class Problems:
    """What is wrong with one host's data, every problem of it. A checker is a function
    ``check(host, *args) -> value`` that raises ``SettingsError`` (or ``SettingsErrors`` for several);
    ``problems.check(checker, *args, default=...)`` records what it raises and gives ``default``
    instead, so the checks after it still run. ``raise_any()`` raises them all at once."""

    def __init__(self, host: str):
        self.host, self.found = host, []

    def add(self, key: str, problem: str, fix: str) -> None:
        self.found.append(SettingsError(self.host, key, problem, fix))

    def check(self, checker, *args, default=None):
        try:
            return checker(self.host, *args)
        except SettingsError as exc:
            self.found.extend(exc.problems)
            return default

    def raise_any(self) -> None:
        if self.found:
            raise SettingsErrors(self.found)


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
    checkpoints: Mapping[str, int] = field(default_factory=lambda: dict(CHECKPOINT_DEFAULTS))
    tracking: Tracking = field(default_factory=Tracking)

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
# A new setting: its default in DEFAULTS, a checker here, one ``p.check`` line in
# load_settings, a field of LabSettings.


def _abs_path(host: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\n" in value or " " in value:
        raise SettingsError(host, key, f"{value!r} is not an absolute path without spaces",
                            f"set {key} to an absolute path such as {DEFAULTS[key]!r}")
    return value.rstrip("/") or "/"


def did_you_mean(value: Any, allowed) -> str:
    """'did you mean X? ' where ``value`` is a near miss of one of ``allowed`` (values, as keys get)."""
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def _choice(host: str, key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise SettingsError(host, key, f"{value!r} is not one of {', '.join(allowed)}",
                            f"{did_you_mean(value, allowed)}set {key} to one of {', '.join(allowed)} in the "
                            "inventory or group_data")
    return value


def _near_misses(host: str, data: Mapping[str, Any]) -> None:
    found = [SettingsError(host, key, "not a verl-lab setting (it would be ignored and the default used)",
                           f"did you mean {near_miss(key)}? (every setting and its default: tasks/settings.py "
                           "DEFAULTS)") for key in data if near_miss(key)]
    if found:
        raise SettingsErrors(found)


def _catalog(host: str, base: Catalog, overrides: Any) -> Catalog:
    if not isinstance(overrides, Mapping):
        raise SettingsError(host, "catalog_overrides", f"{overrides!r} is not a mapping",
                            "use {artifact: {field: value}}")
    try:
        return base.with_overrides(overrides)
    except CatalogError as exc:
        raise SettingsError(host, "catalog_overrides", str(exc),
                            "name a catalog artifact and one of its overridable fields") from None


def _mirrors(host: str, cat: Catalog, profile: Any, urls: Any) -> MirrorSet:
    if not isinstance(urls, Mapping):
        raise SettingsError(host, "mirror_urls", f"{urls!r} is not a mapping", "use {source: base URL}")
    try:
        return cat.mirrors(profile, urls)
    except CatalogError as exc:
        key = "mirror_profile" if "profile" in str(exc) else "mirror_urls"
        fix = (f"set mirror_profile to one of {', '.join(cat.profiles)}" if key == "mirror_profile"
               else "give an http(s) base URL for a source listed in files/catalog.toml [sources]")
        raise SettingsError(host, key, str(exc), fix) from None


def _artifact_name(host: str, cat: Catalog, key: str, name: Any) -> str:
    try:
        cat.artifact(name)
    except CatalogError as exc:
        raise SettingsError(host, key, str(exc), "name an artifact of files/catalog.toml") from None
    return name


def _gpu_override(host: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    example = '{"name": "Tesla T4", "compute_capability": "7.5", "memory_mib": 15360, "count": 1}'
    if not isinstance(value, Mapping) or not {"name", "compute_capability", "memory_mib"} <= set(value) \
            or set(value) - {"name", "compute_capability", "memory_mib", "count"}:
        raise SettingsError(host, "gpu_override", f"{value!r} is not a GPU description", f"use e.g. {example}")
    cc = str(value["compute_capability"])
    count = value.get("count", 1)
    found = []
    try:
        parse_compute_capability(cc)
    except ValueError:
        found.append(SettingsError(host, "gpu_override", f"compute_capability {cc!r} is not like 8.6",
                                   f"use e.g. {example}"))
    for key, num in (("memory_mib", value["memory_mib"]), ("count", count)):
        if not isinstance(num, int) or isinstance(num, bool) or num < 1:
            found.append(SettingsError(host, "gpu_override", f"{key} {num!r} is not a positive integer",
                                       f"use e.g. {example}"))
    if not isinstance(value["name"], str) or not value["name"].strip():
        found.append(SettingsError(host, "gpu_override", f"name {value['name']!r} is not the GPU's name",
                                   f"use e.g. {example}"))
    if found:
        raise SettingsErrors(found)
    return {"name": value["name"], "compute_capability": cc, "memory_mib": value["memory_mib"], "count": count}


def _workload(host: str, value: Any) -> dict[str, Any]:
    example = "workload = {'algorithm': 'grpo', 'max_response_length': 192, 'epochs': 2}"
    if not isinstance(value, Mapping):
        raise SettingsError(host, "workload", f"{value!r} is not a mapping", f"use e.g. {example}")
    found = []
    for key in value:
        if key not in WORKLOAD_DEFAULTS:
            close = difflib.get_close_matches(str(key), sorted(WORKLOAD_DEFAULTS), n=1, cutoff=0.6)
            found.append(SettingsError(host, f"workload.{key}", "not a workload key",
                                       f"did you mean workload.{close[0]}?" if close
                                       else f"use one of {', '.join(WORKLOAD_DEFAULTS)}"))
    w = {**WORKLOAD_DEFAULTS, **{k: v for k, v in value.items() if k in WORKLOAD_DEFAULTS}}
    if w["algorithm"] not in WORKLOAD_ALGORITHMS:
        found.append(SettingsError(host, "workload.algorithm", f"{w['algorithm']!r} is not one of auto, ppo, grpo",
                                   f"{did_you_mean(w['algorithm'], WORKLOAD_ALGORITHMS)}set it to auto (PPO, else GRPO, else shorter responses: what fits), ppo or grpo"))
    if w["rollout"] not in WORKLOAD_ROLLOUTS:
        found.append(SettingsError(host, "workload.rollout", f"{w['rollout']!r} is not one of auto, vllm, hf",
                                   f"{did_you_mean(w['rollout'], WORKLOAD_ROLLOUTS)}set it to auto (vLLM where the GPU runs it, else the HF rollout), vllm (vLLM, "
                                   "on compute capability >= 7.0 only) or hf (the HF-transformers rollout, on any GPU)"))
    found += _finetune(host, w)
    bad = set()
    for key, default in WORKLOAD_DEFAULTS.items():
        if key not in WORKLOAD_WORDS and (not isinstance(w[key], int) or isinstance(w[key], bool) or w[key] < 1):
            bad.add(key)
            found.append(SettingsError(host, f"workload.{key}", f"{w[key]!r} is not a positive integer",
                                       f"set it to a positive integer (default {default})"))
    if not bad & {"ppo_mini_batch_size", "train_batch_size"} and w["ppo_mini_batch_size"] > w["train_batch_size"]:
        found.append(SettingsError(host, "workload.ppo_mini_batch_size", f"{w['ppo_mini_batch_size']} is more than "
                                   f"train_batch_size {w['train_batch_size']}",
                                   "make it at most workload.train_batch_size"))
    if found:
        raise SettingsErrors(found)
    return w


def _finetune(host: str, w: dict[str, Any]) -> list[SettingsError]:
    """workload.finetune and LoRA's target_modules (rank and alpha are positive integers, checked with the others)."""
    found = []
    if w["finetune"] not in WORKLOAD_FINETUNES:
        close = difflib.get_close_matches(str(w["finetune"]).strip().lower(), WORKLOAD_FINETUNES, n=1, cutoff=0.5)
        found.append(SettingsError(host, "workload.finetune", f"{w['finetune']!r} is not one of auto, full, lora",
                                   (f"did you mean {close[0]!r}? " if close else "")
                                   + "set it to auto (LoRA where full fine-tuning needs the CPU-offload rung or does "
                                   "not fit, else full), full (every weight trained) or lora (adapters only)"))
    mods = w["target_modules"]
    if mods != "all-linear":
        names = [mods] if isinstance(mods, str) else mods
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(m, str) for m in names):
            found.append(SettingsError(host, "workload.target_modules", f"{mods!r} is not 'all-linear' or a list of "
                                       "module names",
                                       f"use 'all-linear' (the default) or a list of {', '.join(LORA_MODULES)}"))
        else:
            for m in names:
                if m not in LORA_MODULES:
                    close = difflib.get_close_matches(m, LORA_MODULES, n=1, cutoff=0.6)
                    found.append(SettingsError(host, "workload.target_modules", f"{m!r} is not a linear layer of the "
                                               "model's decoder", (f"did you mean {close[0]!r}? " if close else "")
                                               + f"use 'all-linear' or names of {', '.join(LORA_MODULES)}"))
            if not found:
                w["target_modules"] = "all-linear" if set(names) == set(LORA_MODULES) \
                    else [m for m in LORA_MODULES if m in names]
    return found


def _workload_model(host: str, cat, value: Any, model_artifact: Any, set_artifact: bool) -> str:
    """workload.model: a model artifact of the catalog, by its name or its Hugging Face repo."""
    if value is None:
        return model_artifact
    found = cat.model(value)
    if found is None:
        models = {name: a for name, a in cat.artifacts.items() if a.kind == "hf-model"}
        listed = ", ".join(f"{a.repo} ({name})" for name, a in sorted(models.items()))
        raise SettingsError(host, "workload.model", f"{value!r} is not a model of files/catalog.toml",
                            f"use one of {listed}; another model needs a catalog entry (repo, revision, sha256) "
                            "and its config.json under files/models/")
    if set_artifact and model_artifact != found.name:
        raise SettingsError(host, "workload.model", f"{value!r} and model_artifact {model_artifact!r} name two "
                            "models", "set only workload.model")
    return found.name


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


CLUSTER_EXAMPLE = "cluster = {'name': 'lab1', 'head': 'box1'} on every box of the cluster (e.g. in its group_data)"
CLUSTER_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,30}$")


def _cluster(host: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SettingsError(host, "cluster", f"{value!r} is not a mapping", f"set {CLUSTER_EXAMPLE}")
    found = [SettingsError(host, f"cluster.{key}", "not a cluster key", "use name, head and port")
             for key in value if key not in ("name", "head", "port")]
    for key in ("name", "head"):
        if not isinstance(value.get(key), str) or not value[key].strip():
            found.append(SettingsError(host, f"cluster.{key}", "missing" if key not in value else f"{value[key]!r} "
                                       "is not a name", f"set {CLUSTER_EXAMPLE}" + (
                                           " (head: the inventory name of the box that runs Ray's head)"
                                           if key == "head" else "")))
    if isinstance(value.get("name"), str) and value["name"].strip() and not CLUSTER_NAME_RE.match(value["name"]):
        found.append(SettingsError(host, "cluster.name", f"{value['name']!r} is not a short lowercase name",
                                   "use letters, digits, '-' or '_', e.g. 'lab1'"))
    port = value.get("port", 6379)
    if not isinstance(port, int) or isinstance(port, bool) or not 1024 <= port <= 65535:
        found.append(SettingsError(host, "cluster.port", f"{port!r} is not a port from 1024 to 65535",
                                   "leave it out for Ray's default 6379, or set a free port"))
    if found:
        raise SettingsErrors(found)
    return {"name": value["name"], "head": value["head"], "port": port}


def _ip_address(host: str, key: str, value: Any) -> str | None:
    if value is None:
        return None
    try:
        return str(ipaddress.IPv4Address(value))
    except (ipaddress.AddressValueError, ValueError):
        raise SettingsError(host, key, f"{value!r} is not an IPv4 address",
                            "set the box's address on the cluster network, e.g. '10.0.0.5'") from None


# the cluster setting across hosts (every member's data agrees, the head is a member with an address):
# checked with every host's settings before any host changes (tasks/hostdata.check_inventory)


@dataclass(frozen=True)
class Cluster:
    name: str
    head: str
    head_address: str
    port: int
    members: tuple[str, ...]

    @property
    def address(self) -> str:
        return f"{self.head_address}:{self.port}"

    def role(self, host: str) -> str:
        return "head" if host == self.head else "worker"


def ipv4(value: Any) -> str | None:
    try:
        return str(ipaddress.IPv4Address(str(value)))
    except ValueError:
        return None


def check_clusters(settings: Mapping[str, LabSettings],
                   group_values: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[dict[str, Cluster], list[SettingsError]]:
    """Every cluster of the inventory, and what is wrong with the setting across hosts (a head
    outside its cluster, members that disagree, a head without an address, a box put in two
    clusters by two of its groups). ``group_values``: host -> {group: the cluster value that
    group's data sets}, for boxes whose own host data does not set one."""
    problems: list[SettingsError] = []
    for host, by_group in sorted((group_values or {}).items()):
        names = sorted({f"{g}: {v.get('name')}" for g, v in by_group.items() if isinstance(v, Mapping)})
        if len({v.get("name") for v in by_group.values() if isinstance(v, Mapping)}) > 1:
            problems.append(SettingsError(host, "cluster", f"the box is in two clusters ({', '.join(names)})",
                                          "take it out of one of these groups, or set its own cluster in host data"))
    members: dict[str, list[str]] = {}
    for host, s in settings.items():
        if s.cluster:
            members.setdefault(s.cluster["name"], []).append(host)
    clusters = {}
    for name, hosts in sorted(members.items()):
        first = settings[hosts[0]].cluster
        odd = [h for h in hosts if settings[h].cluster != first]
        if odd:
            problems.append(SettingsError(odd[0], "cluster", f"{settings[odd[0]].cluster!r} differs from "
                                          f"{hosts[0]}'s {first!r} in cluster {name!r}",
                                          f"give every box of {name} the same value (once, in its group's group_data)"))
            continue
        head = first["head"]
        if head not in hosts:
            problems.append(SettingsError(hosts[0], "cluster.head", f"{head!r} is not a box of cluster {name!r} "
                                          f"(its boxes: {', '.join(sorted(hosts))})",
                                          f"name one of them as the head, or put {head} in cluster {name}"))
            continue
        hs = settings[head]
        address = hs.cluster_address or ipv4(hs.raw.get("ssh_hostname") or head)
        if not address:
            problems.append(SettingsError(head, "cluster_address", f"the head of cluster {name!r} has no address "
                                          "the workers can be given", "set cluster_address = '<its IPv4 address "
                                          "on the cluster network>' in its host data"))
            continue
        clusters[name] = Cluster(name, head, address, first["port"], tuple(sorted(hosts)))
    return clusters, problems


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

def _driver_flag(host: str, key: str, value: Any, driver: str) -> bool:
    if _flag(host, key, value) and driver != "install":
        raise SettingsError(host, key, f"True does nothing with driver = {driver!r}",
                            f"set driver = 'install' as well, or leave {key} out")
    return value


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
    p.check(_near_misses, data)
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
        checkpoints=p.check(_checkpoints, merged["checkpoints"], default=dict(CHECKPOINT_DEFAULTS)),
        tracking=p.check(_tracking, merged["tracking"], merged["artifact_mode"], default=Tracking()),
    )
    p.check(_ssh_key, data.get("ssh_key"))
    p.raise_any()
    return settings
