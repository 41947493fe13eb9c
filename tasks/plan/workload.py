"""The workload a host trains: from its settings (``workload_for``), with a catalog model's shape
read from files/models/<name>/config.json before anything is downloaded (``with_model``,
``catalog_model_config``); a model that does not fit is refused naming the catalog's models that
do (``plan_naming_models_that_fit``); a host's override lines for checks inside a built env
(``plan_overrides_for_host``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from tasks.checkpoints import side_files_bytes
from tasks.plan.rungs import make_plan
from tasks.plan.terms import GpuTarget, PlanError, TrainingPlan, Workload

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_CONFIG = REPO_ROOT / "files" / "models" / "qwen2.5-0.5b-instruct" / "config.json"


def catalog_models(catalog) -> list:
    """The catalog's models (kind hf-model), largest first (parameters of their config.json)."""
    from tasks.memory import ModelShape

    models = [a for a in catalog.artifacts.values() if a.kind == "hf-model"]
    return sorted(models, key=lambda a: -ModelShape.from_config(catalog_model_config(a)).params("actor"))


def with_model(workload: Workload, artifact, model_path: str | None = None) -> Workload:
    """``workload`` training another catalog model (its shape, name and, where given, its path)."""
    name = (artifact.repo or artifact.name).rsplit("/", 1)[-1].lower()
    return replace(workload, model_config=catalog_model_config(artifact), model_path=model_path or workload.model_path,
                   experiment_name=f"{name.removesuffix('-instruct')}-gsm8k",
                   model_side_bytes=side_files_bytes(artifact.get("files")))


def plan_naming_models_that_fit(plan: Callable[[Workload], TrainingPlan], workload: Workload, catalog,
                                model: str) -> TrainingPlan:
    """``plan(workload)``; where the model does not fit, the PlanError also names the catalog's
    models that do (largest first, with their rung), or says that none does."""
    try:
        return plan(workload)
    except PlanError as exc:
        if not hasattr(exc, "short_mib"):
            raise
        fits, smallest = [], None
        for a in catalog_models(catalog):
            if a.name == model:
                continue
            try:
                fits.append(f"{a.repo} (rung {plan(with_model(workload, a)).rung})")
            except PlanError as other:
                smallest = (a, other)
        if fits:
            hint = (f" Models of the catalog that fit, largest first: {'; '.join(fits)}: set workload.model to "
                    "one of them in host data.")
        elif smallest:
            hint = (f" No model of the catalog fits: the smallest, {smallest[0].repo}, is short by "
                    f"{getattr(smallest[1], 'short_mib', '?')} MiB too.")
        else:
            hint = ""
        err = PlanError(exc.reason, fix=f"{exc.fix or ''}{hint}".strip() or None, key=exc.key)
        err.short_mib = exc.short_mib
        raise err from None


def load_model_config(path: Path | str = DEFAULT_MODEL_CONFIG) -> dict:
    with open(path) as fh:
        return json.load(fh)


def model_config_path(repo: str) -> Path:
    """The model's config.json kept in the repo (files/models/<name>/), which the plan reads before
    the model is downloaded: e.g. files/models/qwen2.5-1.5b-instruct/config.json."""
    return REPO_ROOT / "files" / "models" / repo.rsplit("/", 1)[-1].lower() / "config.json"


def catalog_model_config(artifact) -> dict:
    """The shape of a catalog model (``tasks.catalog.Artifact`` of kind hf-model)."""
    path = model_config_path(artifact.repo or artifact.name)
    if not path.is_file():
        raise PlanError(f"no config.json for {artifact.repo} at {path.relative_to(REPO_ROOT)}: the plan needs the "
                        "model's shape before it is downloaded; add it there (the config.json of the pinned revision)")
    return load_model_config(path)


def workload_for(settings, flash_attn_installed: bool = False) -> Workload:
    """The GSM8K workload of a host, from its ``LabSettings`` (paths, ``workload``, step cap)."""
    w = settings.workload
    tracking = getattr(settings, "tracking", None)
    tracked = {} if tracking is None else {"trackers": tuple(tracking.logger), "project_name": tracking.project}
    workload = with_model(Workload(
        algorithm=w["algorithm"], train_batch_size=w["train_batch_size"], ppo_mini_batch_size=w["ppo_mini_batch_size"],
        max_prompt_length=w["max_prompt_length"], max_response_length=w["max_response_length"],
        total_epochs=w["epochs"],
        model_path=settings.model_dir,
        train_files=f"{settings.data_dir}/train.parquet",
        # the data stage's first 64 test rows: validation at each checkpoint stays short
        val_files=f"{settings.data_dir}/val_small.parquet",
        checkpoint_dir=f"{settings.train_dir}/checkpoints",
        total_training_steps=settings.train_steps,
        flash_attn_installed=flash_attn_installed,
        save_freq=settings.checkpoints["every"],
        checkpoint_keep=settings.checkpoints["keep"],
        rollout_engine=w["rollout"],
        finetune=w["finetune"], lora_rank=w["lora_rank"], lora_alpha=w["lora_alpha"],
        target_modules=w["target_modules"] if isinstance(w["target_modules"], str) else tuple(w["target_modules"]),
        train_rows=((settings.catalog.artifact(settings.dataset_artifact).get("splits") or {}).get("train") or {})
        .get("rows"),
        **tracked,
    ), settings.catalog.artifact(settings.model_artifact))
    if tracking is None:
        return workload
    # a Ray cluster's members train one run (one plan on every node): named by the cluster, not the box
    cluster = getattr(settings, "cluster", None)
    named = cluster["name"] if isinstance(cluster, Mapping) and cluster.get("name") else settings.host
    return replace(workload, run_name=tracking.run_name or f"{named}-{workload.experiment_name}")


def plan_overrides_for_host(gpu: GpuTarget, settings=None, flash_attn_installed: bool = False) -> list[str]:
    """The Hydra override strings a host with ``gpu`` gets, for checks such as
    ``python -m verl.trainer.main_ppo <overrides> --cfg job`` inside a built env.

    ``settings``: the host's ``LabSettings`` (default: every setting at its default).
    """
    if settings is None:
        from tasks.settings import load_settings

        settings = load_settings("localhost", {})
    return make_plan(gpu, workload_for(settings, flash_attn_installed)).override_lines
