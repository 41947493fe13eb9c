"""The lab's Hugging Face stand-in (tests/fixtures/standins/hf_endpoint.py) serves every model of
files/catalog.toml in the shape the catalog pins, so a newcomer can try each one in the lab: the
real huggingface_hub client and the data stage's own fetcher (verl_lab_box/hf_snapshot.py) download
and verify each, under the catalog_overrides the stand-in gives; its config.json is the one the plan
reads (files/models/). And an endpoint that lacks a model or a revision is told apart (the run's
checks, tasks/base.py relay_problems, read these answers)."""

from __future__ import annotations

import json

import pytest

from tasks.data import data_plan
from tasks.plan.workload import model_config_path
from tasks.settings import load_settings
from tests.fixtures.standins.hf_endpoint import MODEL_REPO, catalog_models, catalog_overrides, standard_endpoint
from verl_lab_box.hf_snapshot import SnapshotError, fetch, list_remote


@pytest.fixture(scope="module")
def endpoint():
    with standard_endpoint() as ep:
        yield ep


@pytest.mark.parametrize("artifact", sorted(catalog_models()))
def test_every_catalog_model_is_served_and_verifies(endpoint, artifact, tmp_path):
    repo = catalog_models()[artifact]
    s = load_settings("b", {"catalog_overrides": catalog_overrides(endpoint), "workload": {"model": repo}})
    spec = data_plan(s).model
    assert spec.artifact == artifact and spec.repo == repo
    got = fetch(spec, tmp_path / "snap", endpoint.url, progress=False)
    assert set(spec.files) <= set(got)
    served = (tmp_path / "snap" / "config.json").read_bytes()
    if repo == MODEL_REPO:      # the tiny Qwen2 whose weights load (CPU training, the export's proof)
        assert json.loads(served)["model_type"] == "qwen2" and json.loads(served)["hidden_size"] == 64
    else:
        assert served == model_config_path(repo).read_bytes()
    assert json.loads((tmp_path / "snap" / "tokenizer_config.json").read_text())["chat_template"]


def test_an_endpoint_without_the_model_or_the_revision_says_which(tmp_path):
    with standard_endpoint(models=()) as ep:           # only the 0.5B model and GSM8K
        overrides = catalog_overrides(ep)
        assert "qwen_1_5b_model" not in overrides
        s = load_settings("b", {"catalog_overrides": overrides, "workload": {"model": "Qwen/Qwen2.5-1.5B-Instruct"}})
        with pytest.raises(SnapshotError, match="the endpoint has no such repo"):
            list_remote(data_plan(s).model, ep.url, None)
        bad = {**overrides, "qwen_model": {**overrides["qwen_model"], "revision": "0" * 40}}
        s = load_settings("b", {"catalog_overrides": bad})
        with pytest.raises(SnapshotError, match="the endpoint has no such revision"):
            list_remote(data_plan(s).model, ep.url, None)
