"""The data stage's plan (pure): which model and dataset snapshots a host gets, from where, into
which folders, and the rows its GSM8K splits must have; from the host's settings alone.

The data stage (tasks/data/stage.py) carries it out; the inventory pass (tasks/validation.py) makes it
for every host before any host changes, so a bad catalog override stops the run there.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tasks.catalog import CatalogError
from tasks.settings import LabSettings, SettingsError
from verl_lab_box import gsm8k
from verl_lab_box import hf_snapshot as hfsnapshot
from verl_lab_box.hf_snapshot import RepoSpec, SnapshotError

# box-side programs, by their names in <lab_root>/libexec/data
SCRIPTS = {"hfsnapshot.py": Path(hfsnapshot.__file__), "gsm8k.py": Path(gsm8k.__file__)}


@dataclass(frozen=True)
class DataPlan:
    """Everything the stage decides for one host, from its settings alone (pure)."""

    endpoint: str
    mode: str
    model: RepoSpec
    dataset: RepoSpec
    model_dir: str
    data_dir: str
    source_dir: str
    train_file: str            # relative to source_dir
    test_file: str
    rows: dict                 # train / test / val_small -> expected row count
    tools_dir: str
    secrets_dir: str
    env_python: str

    @property
    def endpoint_shown(self) -> str:
        """The endpoint without any user:password@ part (for the marker)."""
        url = urlsplit(self.endpoint)
        return url._replace(netloc=url.netloc.rpartition("@")[2]).geturl()

    @property
    def val_rows(self) -> int:
        return self.rows["val_small"]

    @property
    def digest(self) -> str:
        scripts = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in SCRIPTS.items()}
        return hashlib.sha256(json.dumps({
            "model": self.model.digest, "dataset": self.dataset.digest, "rows": self.rows,
            "model_dir": self.model_dir, "data_dir": self.data_dir, "scripts": scripts,
        }, sort_keys=True).encode()).hexdigest()

    @property
    def outputs(self) -> list[str]:
        return [f"{self.data_dir}/{name}" for name in gsm8k.OUTPUTS.values()]

    @property
    def proof_paths(self) -> list[str]:
        """Files whose presence the re-run check asks for (cheap: a stat each)."""
        return ([f"{self.model_dir}/config.json"] + [f"{self.model_dir}/{n}" for n in sorted(self.model.files)]
                + [f"{self.source_dir}/{self.train_file}", f"{self.source_dir}/{self.test_file}"] + self.outputs)

    def box_modules(self) -> tuple[str, ...]:
        return ("pyarrow", "huggingface_hub") if self.mode == "direct" else ("pyarrow",)


def _check_fields(want: dict) -> dict:
    return {k: want[k] for k in ("size", "sha256") if k in want}


def _spec(settings: LabSettings, key: str, kind: str) -> RepoSpec:
    name = getattr(settings, key)
    try:
        art = settings.catalog.artifact(name)
    except CatalogError as exc:
        raise SettingsError(settings.host, key, str(exc), "name an artifact of files/catalog.toml") from None
    if art.kind != kind:
        raise SettingsError(settings.host, key, f"artifact {name!r} is of kind {art.kind!r}, not {kind!r}",
                            f"name a catalog artifact of kind {kind!r}")
    files_ = art.get("files") or {}
    if not isinstance(files_, dict) or not all(isinstance(v, dict) for v in files_.values()):
        raise SettingsError(settings.host, f"catalog_overrides.{name}.files", "must map file names to "
                            "{size, sha256}", "e.g. {'model.safetensors': {'size': 123, 'sha256': '...'}}")
    repo_type = "model" if kind == "hf-model" else "dataset"
    patterns = hfsnapshot.MODEL_PATTERNS if repo_type == "model" else ()
    if repo_type == "dataset" and not files_:
        raise SettingsError(settings.host, f"catalog_overrides.{name}.files", "a dataset artifact lists no files",
                            "list the split parquet files (e.g. main/train-00000-of-00001.parquet)")
    try:
        return RepoSpec(artifact=name, repo=art.repo, revision=art.revision or "", repo_type=repo_type,
                        files={n: _check_fields(v) for n, v in files_.items()}, patterns=patterns)
    except SnapshotError as exc:
        raise SettingsError(settings.host, f"catalog_overrides.{name}.revision", str(exc),
                            "pin a 40-digit commit sha of the repo") from None


def _splits(settings: LabSettings, spec: RepoSpec) -> tuple[str, str, dict]:
    art = settings.catalog.artifact(spec.artifact)
    files_ = art.get("files") or {}
    splits = art.get("splits") or {}
    config = art.get("config") or "main"
    chosen, rows = {}, {}
    for split in ("train", "test"):
        entry = splits.get(split) or {}
        fname = entry.get("file")
        if fname not in files_:
            # the Hub's parquet layout: <config>/<split>-NNNNN-of-NNNNN.parquet
            guesses = sorted(n for n in files_ if n.startswith(f"{config}/{split}-") and n.endswith(".parquet"))
            if len(guesses) != 1:
                raise SettingsError(settings.host, f"catalog_overrides.{spec.artifact}.files",
                                    f"cannot tell which file is the {split} split",
                                    f"name it {config}/{split}-00000-of-00001.parquet")
            fname, entry = guesses[0], {}
        count = files_[fname].get("rows", entry.get("rows"))
        if not isinstance(count, int) or count < 1:
            raise SettingsError(settings.host, f"catalog_overrides.{spec.artifact}.files",
                                f"no row count for the {split} split ({fname})",
                                f"add rows = N to files.{fname!r} (the proof checks it)")
        chosen[split], rows[split] = fname, count
    rows["val_small"] = min(gsm8k.VAL_ROWS, rows["test"])
    return chosen["train"], chosen["test"], rows


def data_plan(settings: LabSettings) -> DataPlan:
    """Decide the stage for one host; raise SettingsError on bad input (nothing has changed yet)."""
    model = _spec(settings, "model_artifact", "hf-model")
    dataset = _spec(settings, "dataset_artifact", "hf-dataset")
    train_file, test_file, rows = _splits(settings, dataset)
    return DataPlan(
        endpoint=settings.mirrors.base("huggingface"),
        mode=settings.artifact_mode,
        model=model,
        dataset=dataset,
        model_dir=settings.model_dir,
        data_dir=settings.data_dir,
        source_dir=f"{settings.data_dir}/source",
        train_file=train_file,
        test_file=test_file,
        rows=rows,
        tools_dir=f"{settings.lab_root}/libexec/data",
        secrets_dir=f"{settings.lab_root}/secrets",
        env_python=settings.env_python,
    )
