"""The catalog: the repo's own file is valid, and every rule that guards it can fail."""

import copy

import pytest

from tasks.catalog import Catalog, CatalogError, check_base_url, default_catalog

BASE = {
    "profiles": ["global", "cn"],
    "sources": {"nvidia": {"global": "https://dl.example.com/compute", "cn": "https://dl.example.cn/compute"}},
    "artifacts": {
        "blob": {"kind": "file", "source": "nvidia", "path": "a/b/blob.tar.xz", "version": "1.0",
                 "sha256": "a" * 64, "size": 10},
    },
}


def make(**changes):
    data = copy.deepcopy(BASE)
    data["artifacts"]["blob"].update(changes)
    return data


def test_repo_catalog_loads_and_pins_what_facts_list():
    cat = default_catalog()
    cuda = cat.artifact("cuda_runfile")
    assert cuda.sha256 == "9223c4af3aebe4a7bbed9abd9b163b03a1b34b855fbc2b4a0d1b706ac09a5a16"
    cudnn = cat.artifact("cudnn_archive")
    assert cudnn.size == 860_967_256
    assert cat.artifact("verl").ref == "v0.5.0"
    qwen = cat.artifact("qwen_model")
    assert qwen.revision == "7ae557604adf67be50417f59c2c2f167def9a775"
    assert qwen.get("files")["model.safetensors"]["size"] == 988_097_824
    for art in cat.artifacts.values():
        assert art.sha256 or art.no_checksum or art.get("files"), art.name


def test_xformers_comes_from_the_torch_artifacts_cu118_index():
    """vLLM 0.8.5 pins xformers==0.0.29.post2; PyPI's build of it is CUDA 12.4, the cu118 index's
    file of the same name is the build for torch cu118: the catalog names that index, per profile."""
    cat = default_catalog()
    xformers, torch = cat.artifact("xformers"), cat.artifact("torch")
    assert xformers.kind == "pip-index" and xformers.version == "0.0.29.post2"
    assert xformers.get("requirements") == ["xformers==0.0.29.post2"] and xformers.get("cuda") == "11.8"
    for profile in cat.profiles:
        assert xformers.url(cat.mirrors(profile)) == torch.url(cat.mirrors(profile))
    assert xformers.url(cat.mirrors("global")) == "https://download.pytorch.org/whl/cu118"
    assert xformers.url(cat.mirrors("cn")) == "https://mirror.nju.edu.cn/pytorch/whl/cu118"


def test_urls_follow_profile_and_overrides():
    cat = default_catalog()
    cudnn = cat.artifact("cudnn_archive")
    assert cudnn.url(cat.mirrors("global")).startswith("https://developer.download.nvidia.com/compute/cudnn/redist/")
    assert cudnn.url(cat.mirrors("cn")).startswith("https://developer.download.nvidia.cn/compute/")
    assert cat.artifact("qwen_model").url(cat.mirrors("cn")) == "https://hf-mirror.com"
    local = cat.mirrors("global", {"nvidia": "http://127.0.0.1:8000/nvidia/"})
    assert cudnn.url(local) == "http://127.0.0.1:8000/nvidia/" + cudnn.path


def test_missing_checksum_is_an_error_unless_explained():
    data = make()
    del data["artifacts"]["blob"]["sha256"]
    with pytest.raises(CatalogError, match="no sha256.*no_checksum"):
        Catalog.from_dict(data)
    data["artifacts"]["blob"]["no_checksum"] = "signed by the vendor"
    assert Catalog.from_dict(data).artifact("blob").no_checksum


@pytest.mark.parametrize("changes, message", [
    ({"sha256": "ABC"}, "64 lowercase hex"),
    ({"kind": "tarball"}, "kind 'tarball'"),
    ({"source": "nope"}, "source 'nope'"),
    ({"size": -1}, "positive integer"),
    ({"version": ""}, "no version"),
    ({"path": ""}, "no path"),
])
def test_bad_entries_are_refused(changes, message):
    with pytest.raises(CatalogError, match=message):
        Catalog.from_dict(make(**changes))


def test_unknown_artifact_and_profile_name_the_choices():
    cat = Catalog.from_dict(make())
    with pytest.raises(CatalogError, match="unknown artifact 'cuda'.*blob"):
        cat.artifact("cuda")
    with pytest.raises(CatalogError, match="unknown mirror profile 'eu'.*global, cn"):
        cat.mirrors("eu")
    with pytest.raises(CatalogError, match="unknown source 'pypi'"):
        cat.mirrors("global", {"pypi": "https://pypi.example"})


@pytest.mark.parametrize("url, why", [
    ("ftp://x.example", "scheme"),
    ("https://", "no host"),
    (" https://x.example", "whitespace"),
    ("https://x.example/?a=1", "query"),
    ("", "non-empty"),
])
def test_bad_base_urls(url, why):
    assert why in check_base_url(url)


def test_overrides_replace_fields_and_reject_unknown_ones():
    cat = Catalog.from_dict(make())
    new = cat.with_overrides({"blob": {"sha256": "b" * 64, "size": 99}})
    assert new.artifact("blob").sha256 == "b" * 64 and new.artifact("blob").size == 99
    assert cat.artifact("blob").sha256 == "a" * 64  # the original is untouched
    with pytest.raises(CatalogError, match="unknown artifact 'nope'"):
        cat.with_overrides({"nope": {"size": 1}})
    with pytest.raises(CatalogError, match="not an overridable field"):
        cat.with_overrides({"blob": {"colour": "red"}})
    with pytest.raises(CatalogError, match="must be int"):
        cat.with_overrides({"blob": {"size": "10"}})
