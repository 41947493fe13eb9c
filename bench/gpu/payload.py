"""Build `.gpu/`: everything the device machine needs to run real verl 0.5.0 PPO, made here.

The device machine (bench/gpu/install.sh runs there) has no network: Python 3.12 with torch
2.11, numpy 2.x, pandas, pyarrow, accelerate, safetensors, triton and more, but transformers
5.x and huggingface_hub 1.x (too new for verl 0.5.0) and no Ray, no Hydra. A call carries at
most 64 MiB of working tree, so this folder (ignored by git, named in the call's `carry`) must
stay under 56 MiB. It holds:

- ``wheels/``: the cp312 manylinux / pure wheels of ``PINS`` below (verl's runtime needs that
  the image lacks or has too new), from PyPI; the two sdist-only ones are built with
  ``pip wheel --no-deps``.
- ``ray-2.46.0.tar.xz``: the ray 2.46.0 cp312 wheel's files and dist-info without ``ray/jars/``
  (the Java worker, 32 MB), recompressed: it unpacks straight into the ``pip --target`` folder.
- ``verl/<NAME>.tar.xz`` + ``verl/<NAME>.json``: the ``verl/`` package of the verl 0.5.0 sdist
  with the project's patch set ``files/patches/verl-0.5.0/*.diff`` as of a git ref
  (``--verl-tree NAME=REF``; ``WORKTREE`` = the files in the working tree now) applied in name
  order with ``git apply``.
- ``tokenizer/``: a Qwen2-compatible tokenizer made here (no PyPI package ships Qwen2.5's
  vocabulary): a byte-level BPE trained with ``tokenizers`` on GSM8K-shaped text and common
  words, with Qwen2's pre-tokenizer (the ``Split`` regex, then ByteLevel without its own regex),
  151643 regular tokens (filled up with unused ``<fillN>`` tokens), Qwen's special tokens at
  their real ids (``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>`` 151645) and
  Qwen2.5-Instruct's chat template. ``tokenizer_class`` is ``Qwen2TokenizerFast``: verl and
  transformers load the folder with ``AutoTokenizer.from_pretrained`` (transformers is not in
  this machine's venv; bench/gpu/make_model.py proves that load on the device at run time).
  Here it is proven with ``tokenizers`` alone: round trip, special ids, vocab size 151646.
- ``data/``: 2048 train + 256 test GSM8K-shaped rows (seeded), written as the ``openai/gsm8k``
  parquet pair (``data/raw/main/``) and turned into verl's format by the project's own
  ``verl_lab_box/gsm8k.py`` (build, then prove), exactly as a box's data stage does:
  ``train.parquet``, ``test.parquet``, ``val_small.parquet`` (64 rows).

Idempotent: ``.gpu/build.json`` records what each part was built from (pins, sha256s, recipe
digests); a part whose record and files still match is skipped. ``--force`` rebuilds all.
Downloads (the 68.5 MB Ray wheel, sdists) are cached in ``--cache``, outside ``.gpu/``.

    .venv/bin/python bench/gpu/payload.py [--out .gpu] [--verl-tree NAME=REF ...] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tasks.fetch import sha256_of  # noqa: E402

LIMIT_MIB = 56  # the call's 64 MiB less the tracked tree (~2 MiB) and some room
DEFAULT_CACHE = Path.home() / ".cache" / "verl-lab-gpu-payload"
DEFAULT_SDIST = Path("/root/.cache/verl-lab-test/sdist/verl-0.5.0.tar.gz")
PATCH_DIR = "files/patches/verl-0.5.0"
DEFAULT_TREES = ("today=7d6e4b8", "speed-before=aa9f1e3", "current=WORKTREE")   # ppo_profiles.py's code refs
# the burn-in's mutated run (bench/gpu/burnin_profiles.py): "current" with a test-only patch, as "current-<name>"
MUTATIONS = REPO / "tests" / "fixtures" / "burnin" / "mutations"
BURNIN_MUTATIONS = ("advantage-sign-flipped",)
INDEX = "https://pypi.org/simple"
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                 "--platform", "manylinux2014_x86_64"]

# The wheels the device lacks, one version each: (distribution, version, how it comes).
# "wheel": pip download of a cp312 manylinux or py3-none-any wheel; "sdist": PyPI has no wheel,
# built here with `pip wheel --no-deps` (pure Python, so the wheel is py3-none-any).
# Left out on purpose, because the image has them in a version that works: accelerate,
# numpy (2.x; verl's metadata asks <2 but it runs), pandas, pyarrow, safetensors, torch,
# aiohttp & co (fsspec[http]), click, filelock, msgpack, protobuf, pyyaml, requests, aiosignal,
# frozenlist, attrs, xxhash, hf-xet, regex, tqdm, cloudpickle, zipp, typing-extensions, psutil.
# Not needed: wandb (verl imports it only for the wandb logger), pybind11 (build-time only),
# ray's [default] extras (dashboard, not used by verl's single-node ray.init).
PINS = [
    ("transformers", "4.54.1", "wheel"),      # the image's 5.x is too new for verl 0.5.0
    ("tokenizers", "0.21.4", "wheel"),        # transformers 4.54.1 wants >=0.21,<0.22 (abi3 wheel)
    ("huggingface_hub", "0.34.6", "wheel"),   # transformers 4.54.1 wants >=0.34,<1.0; image has 1.x
    ("peft", "0.16.0", "wheel"),              # the image's peft expects transformers 5.x
    ("datasets", "4.0.0", "wheel"),           # verl's RLHFDataset reads parquet through it
    ("fsspec", "2025.3.0", "wheel"),          # datasets 4.0.0 wants fsspec<=2025.3.0
    ("dill", "0.3.8", "wheel"),               # datasets 4.0.0 wants dill<0.3.9
    ("multiprocess", "0.70.16", "wheel"),     # datasets 4.0.0 wants <0.70.17 (py312 wheel)
    ("tensordict", "0.9.1", "wheel"),         # verl: >=0.8.0,<=0.9.1,!=0.9.0; its C++ part loads under torch 2.11
    ("pyvers", "0.1.0", "wheel"),             # tensordict 0.9.1 wants pyvers<0.2.0
    ("orjson", "3.11.1", "wheel"),            # tensordict (python < 3.13)
    ("importlib_metadata", "8.7.0", "wheel"), # tensordict; newer ones need lazy-importer too
    ("torchdata", "0.11.0", "wheel"),         # verl's StatefulDataLoader
    ("hydra-core", "1.3.2", "wheel"),
    ("omegaconf", "2.3.0", "wheel"),
    ("antlr4-python3-runtime", "4.9.3", "sdist"),  # omegaconf/hydra want ==4.9.*; sdist only
    ("pylatexenc", "2.10", "sdist"),          # verl's math reward scorer; sdist only
    ("codetiming", "1.4.0", "wheel"),         # verl's timers
    ("jsonschema", "4.25.1", "wheel"),        # ray 2.46.0 (Requires-Dist)
    ("referencing", "0.36.2", "wheel"),       # jsonschema
    ("jsonschema-specifications", "2025.4.1", "wheel"),  # jsonschema
    ("rpds-py", "0.27.1", "wheel"),           # referencing / jsonschema (compiled, cp312)
]
RAY = ("ray", "2.46.0")

# tokenizer recipe (Qwen2's tokenizer.json: NFC, Split(regex, isolated), ByteLevel without regex)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
REGULAR_TOKENS = 151643
SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
CORPUS_ROWS = 6000
CORPUS_SEED = 7
# Qwen2.5-Instruct's chat template without its tool-call branches (verl passes no tools).
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\") %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

TRAIN_ROWS, TEST_ROWS, VAL_ROWS = 2048, 256, 64
DATA_SEED = 20250  # train rows; test rows use DATA_SEED + 1
RAW_FILES = {"train": "raw/main/train-00000-of-00001.parquet", "test": "raw/main/test-00000-of-00001.parquet"}


def log(msg: str) -> None:
    print(f"payload: {msg}", flush=True)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def pip_env() -> dict:
    # This machine's pip config adds find-links, an extra local index and a constraints file;
    # the payload must come from PyPI itself.
    env = dict(os.environ)
    env["PIP_CONFIG_FILE"] = os.devnull
    for key in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_INDEX_URL"):
        env.pop(key, None)
    return env


def pip(args: list[str], python: str) -> None:
    cmd = [python, "-m", "pip", *args, "--index-url", INDEX, "--disable-pip-version-check"]
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, env=pip_env())


def norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def wheel_matches(filename: str, name: str, version: str) -> bool:
    parts = filename[:-4].split("-") if filename.endswith(".whl") else []
    return len(parts) >= 5 and norm(parts[0]) == norm(name) and parts[1] == version


def wheel_ok(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as zf:
            return any(n.endswith(".dist-info/METADATA") for n in zf.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


class Record:
    """``.gpu/build.json``: one entry per part, saved after each part is built."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.data = json.loads(path.read_text())
        except (OSError, ValueError):
            self.data = {}

    def get(self, key: str):
        return self.data.get(key)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)


# ------------------------------------------------------------------------------------ wheels

def build_wheels(out: Path, cache: Path, record: Record, python: str, force: bool) -> None:
    wdir = out / "wheels"
    have = record.get("wheels") or {}
    pins = [f"{n}=={v}" for n, v, _ in PINS]
    if (not force and have.get("pins") == pins and wdir.is_dir()
            and sorted(p.name for p in wdir.iterdir()) == sorted(have["files"])
            and all(sha256_of(wdir / f) == s for f, s in have["files"].items())):
        log(f"wheels: {len(pins)} unchanged")
        return
    wdir.mkdir(parents=True, exist_ok=True)
    dl = cache / "wheels"
    dl.mkdir(parents=True, exist_ok=True)
    missing = [(n, v, k) for n, v, k in PINS
               if not any(wheel_matches(p.name, n, v) and wheel_ok(p) for p in dl.iterdir())]
    binary = [f"{n}=={v}" for n, v, k in missing if k == "wheel"]
    if binary:
        pip(["download", "--no-deps", *PLATFORM_ARGS, "-d", str(dl), *binary], python)
    for n, v, k in missing:
        if k == "sdist":
            pip(["wheel", "--no-deps", "--no-binary", ":all:", "-w", str(dl), f"{n}=={v}"], python)
    files = {}
    for n, v, _ in PINS:
        found = [p for p in dl.iterdir() if wheel_matches(p.name, n, v) and wheel_ok(p)]
        if len(found) != 1:
            raise SystemExit(f"payload: wheel {n}=={v}: found {[p.name for p in found]} in {dl}")
        tags = found[0].name[:-4].split("-")[-3:]
        if not (tags[0] in ("py3", "cp312", "cp39", "py312") and
                (tags[2] == "any" or "manylinux" in tags[2] and "x86_64" in tags[2])):
            raise SystemExit(f"payload: {found[0].name} is not a cp312 manylinux x86_64 / py3-none-any wheel")
        files[found[0].name] = found[0]
    for p in wdir.iterdir():  # one version of each: anything else would stop pip install
        if p.name not in files:
            p.unlink()
    for name, src in files.items():
        dest = wdir / name
        if not dest.exists() or sha256_of(dest) != sha256_of(src):
            shutil.copyfile(src, dest)
    record.put("wheels", {"pins": pins, "files": {f: sha256_of(wdir / f) for f in sorted(files)}})
    log(f"wheels: {len(files)} in {wdir}")


# --------------------------------------------------------------------------------------- ray

def pack_without_jars(whl: Path, dest: Path) -> tuple[int, int]:
    """The wheel's files (dist-info too) minus ``ray/jars/`` as a tar.xz (preset 9) that unpacks
    straight into a ``pip --target`` folder; returns (bytes kept, bytes dropped)."""
    tmp = dest.with_name(dest.name + ".tmp")
    kept = dropped = 0
    with zipfile.ZipFile(whl) as zf, tarfile.open(tmp, "w:xz", preset=9, format=tarfile.PAX_FORMAT) as tf:
        for info in sorted(zf.infolist(), key=lambda i: i.filename):
            if info.is_dir():
                continue
            if info.filename.startswith("ray/jars/"):
                dropped += info.file_size
                continue
            if info.filename.split("/", 1)[0].endswith(".data"):
                raise SystemExit(f"payload: {info.filename}: a .data entry would need pip to place it")
            mode = (info.external_attr >> 16) & 0o777
            ti = tarfile.TarInfo(info.filename)
            ti.size = info.file_size
            ti.mode = 0o755 if mode & 0o111 else 0o644
            ti.mtime = 0
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            with zf.open(info) as fh:
                tf.addfile(ti, fh)
            kept += info.file_size
    os.replace(tmp, dest)
    return kept, dropped


def build_ray(out: Path, cache: Path, record: Record, python: str, force: bool) -> None:
    name, version = RAY
    dest = out / f"{name}-{version}.tar.xz"
    have = record.get("ray") or {}
    if not force and dest.is_file() and have.get("tar_sha256") == sha256_of(dest):
        log(f"ray: {dest.name} unchanged")
        return
    dl = cache / "ray"
    dl.mkdir(parents=True, exist_ok=True)
    wheels = [p for p in dl.glob("*.whl") if wheel_matches(p.name, name, version) and wheel_ok(p)]
    if not wheels:
        pip(["download", "--no-deps", *PLATFORM_ARGS, "-d", str(dl), f"{name}=={version}"], python)
        wheels = [p for p in dl.glob("*.whl") if wheel_matches(p.name, name, version) and wheel_ok(p)]
    if len(wheels) != 1 or "cp312-cp312-manylinux2014_x86_64" not in wheels[0].name:
        raise SystemExit(f"payload: ray wheel: found {[p.name for p in wheels]} in {dl}")
    whl = wheels[0]
    log(f"ray: {whl.name} ({mib(whl.stat().st_size)}) -> {dest.name} without ray/jars/, xz preset 9")
    kept, dropped = pack_without_jars(whl, dest)
    record.put("ray", {"wheel": whl.name, "wheel_sha256": sha256_of(whl), "tar_sha256": sha256_of(dest),
                       "unpacked_bytes": kept, "dropped_jars_bytes": dropped})
    log(f"ray: {mib(kept)} unpacked, {mib(dropped)} of jars dropped, {dest.name} {mib(dest.stat().st_size)}")


# -------------------------------------------------------------------------------------- verl

def git(*args: str, cwd: Path = REPO, binary: bool = False):
    res = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)
    return res.stdout if binary else res.stdout.decode()


def patch_set(ref: str) -> tuple[str, list[tuple[str, bytes]]]:
    """(the commit or WORKTREE, [(name, bytes)]) of the patch set as of ``ref``, in name order."""
    if ref == "WORKTREE":
        paths = sorted((REPO / PATCH_DIR).glob("*.diff"))
        return "WORKTREE", [(p.name, p.read_bytes()) for p in paths]
    try:
        commit = git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").strip()
    except subprocess.CalledProcessError:
        raise SystemExit(f"payload: --verl-tree ref {ref!r} is no commit of {REPO}") from None
    names = sorted(n.rsplit("/", 1)[-1] for n in git("ls-tree", "--name-only", commit, PATCH_DIR + "/").split()
                   if n.endswith(".diff"))
    return commit, [(n, git("show", f"{commit}:{PATCH_DIR}/{n}", binary=True)) for n in names]


def verl_sdist(path: Path, cache: Path, python: str) -> Path:
    if path.is_file():
        return path
    dl = cache / "sdist"
    found = sorted(dl.glob("verl-0.5.0.tar.gz")) if dl.is_dir() else []
    if not found:
        dl.mkdir(parents=True, exist_ok=True)
        pip(["download", "--no-deps", "--no-binary", ":all:", "-d", str(dl), "verl==0.5.0"], python)
        found = sorted(dl.glob("verl-0.5.0.tar.gz"))
    if not found:
        raise SystemExit(f"payload: no verl-0.5.0.tar.gz at {path} or in {dl}")
    return found[0]


def build_verl_tree(out: Path, name: str, ref: str, commit: str, patches: list[tuple[str, bytes]], sdist: Path,
                    record: Record, force: bool) -> None:
    vdir = out / "verl"
    vdir.mkdir(parents=True, exist_ok=True)
    dest, meta_path = vdir / f"{name}.tar.xz", vdir / f"{name}.json"
    meta = {"name": name, "ref": ref, "commit": commit, "sdist": sdist.name, "sdist_sha256": sha256_of(sdist),
            "patches": [{"name": n, "sha256": sha256_bytes(b)} for n, b in patches]}
    try:
        old = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        old = None
    if (not force and old and dest.is_file() and {k: old.get(k) for k in meta} == meta
            and old.get("tar_sha256") == sha256_of(dest)):
        log(f"verl {name}: unchanged ({ref}, {len(patches)} patches)")
        return
    with tempfile.TemporaryDirectory(prefix="verl-tree-") as tmp:
        tmp = Path(tmp)
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        roots = [p for p in tmp.iterdir() if p.is_dir()]
        if len(roots) != 1 or not (roots[0] / "verl" / "__init__.py").is_file():
            raise SystemExit(f"payload: {sdist} is not a verl sdist")
        root = roots[0]
        git("init", "-q", cwd=root)  # git apply wants a repository (paths in the diffs are a/verl/...)
        for n, body in patches:
            pf = tmp / n
            pf.write_bytes(body)
            try:
                git("apply", "--check", str(pf), cwd=root)
                git("apply", str(pf), cwd=root)
            except subprocess.CalledProcessError as exc:
                raise SystemExit(f"payload: {n} (as of {ref}) does not apply to {sdist.name}: "
                                 f"{exc.stderr.decode().strip()}") from None
        for cache_dir in list(root.joinpath("verl").rglob("__pycache__")):
            shutil.rmtree(cache_dir)
        files = sorted(p for p in root.joinpath("verl").rglob("*") if p.is_file() and not p.name.endswith(".pyc"))
        tmp_tar = dest.with_name(dest.name + ".tmp")
        with tarfile.open(tmp_tar, "w:xz", preset=9, format=tarfile.PAX_FORMAT) as tf:
            for p in files:
                ti = tf.gettarinfo(str(p), arcname=str(p.relative_to(root)))
                ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = 0, 0, 0, "", ""
                ti.mode = 0o644
                with open(p, "rb") as fh:
                    tf.addfile(ti, fh)
        os.replace(tmp_tar, dest)
    meta["files"] = len(files)
    meta["tar_sha256"] = sha256_of(dest)
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    record.put(f"verl:{name}", {"ref": ref, "commit": commit, "tar_sha256": meta["tar_sha256"]})
    log(f"verl {name}: {ref} ({commit[:12]}), {len(patches)} patches, {len(files)} files, {mib(dest.stat().st_size)}")


# -------------------------------------------------------------------------------------- data

def gsm8k_module():
    """The project's verl_lab_box/gsm8k.py (pure: pyarrow and the standard library)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("verl_lab_gsm8k", REPO / "verl_lab_box" / "gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NAMES = [("Natalia", "she"), ("Weng", "she"), ("Betty", "she"), ("Julie", "she"), ("James", "he"),
         ("Albert", "he"), ("Tina", "she"), ("Marco", "he"), ("Priya", "she"), ("Carlos", "he"),
         ("Mei", "she"), ("Omar", "he"), ("Hannah", "she"), ("Lucas", "he"), ("Aisha", "she"),
         ("Ben", "he"), ("Sofia", "she"), ("Daniel", "he"), ("Grace", "she"), ("Kevin", "he"),
         ("Rosa", "she"), ("Tom", "he"), ("Yuki", "she"), ("Ahmed", "he"), ("Emma", "she"),
         ("Jack", "he"), ("Olivia", "she"), ("Mateo", "he"), ("Chloe", "she"), ("Ravi", "he"),
         ("Nora", "she"), ("Samuel", "he"), ("Lily", "she"), ("Ethan", "he"), ("Fatima", "she"),
         ("Noah", "he"), ("Zoe", "she"), ("Liam", "he"), ("Ivy", "she"), ("Felix", "he")]
PLACES = ["farmers market", "school fair", "corner store", "flea market", "bake sale", "county fair",
          "craft show", "street festival"]
GOODS = ["cupcakes", "muffins", "bracelets", "candles", "jars of jam", "loaves of bread", "pies",
         "boxes of cookies", "paintings", "scarves", "bags of apples", "bouquets"]
JOBS = ["babysitter", "cashier", "dog walker", "tutor", "lifeguard", "waiter", "gardener", "painter",
        "delivery driver", "librarian"]
EXPENSES = ["groceries", "her phone bill", "gas", "a new pair of shoes", "rent", "lunch with friends",
            "a bus pass", "books"]
THINGS = [("notebooks", "pens"), ("balloons", "party hats"), ("paint brushes", "canvases"),
          ("apples", "oranges"), ("shirts", "pairs of socks"), ("plates", "cups"), ("folders", "markers")]
EVENTS = ["a birthday party", "the new school year", "an art class", "a family picnic", "a camping trip",
          "a science project"]
GOALS = ["bicycle", "video game console", "guitar", "tablet", "pair of roller skates", "telescope",
         "camera", "skateboard"]
SOURCES = ["her allowance", "mowing lawns", "walking dogs", "his part-time job", "selling lemonade",
           "doing chores"]
RELATIVES = ["grandmother", "uncle", "aunt", "cousin", "grandfather", "older sister", "best friend"]
TREATS = [("cookie", "jar"), ("candy", "bag"), ("marble", "box"), ("sticker", "pack"), ("grape", "bowl"),
          ("pretzel", "tin")]
PRODUCTS = ["jacket", "lamp", "backpack", "board game", "pair of boots", "coffee maker", "watch", "chair"]
PLANTS = ["tomato", "pepper", "sunflower", "rose", "cabbage", "lettuce", "bean", "tulip"]
ANIMALS = [("chickens", 2), ("cows", 4), ("ducks", 2), ("goats", 4), ("horses", 4), ("pigs", 4), ("geese", 2)]
FACTORY = ["toys", "bottles", "chairs", "shirts", "cans of soup", "pencils", "bricks"]
CONTEXT = [
    "{name} lives in a small town near the coast and likes to keep careful notes.",
    "Every weekend, {name} spends the morning planning the week ahead.",
    "{name} has been thinking about this for a while and wants to get the numbers right.",
    "{Pron} asked a friend to help check the math, but the friend was busy.",
    "It is the first week of the month, and the weather has been sunny and warm.",
    "{name} wrote everything down in a small notebook to keep track.",
    "Last year, things went a little differently, so this time {pron} is being more careful.",
    "The whole family is curious about the result.",
    "{name} likes to solve problems like this one during the bus ride home.",
    "All of the prices are the same as they were the week before.",
    "Nothing else changes during this time.",
    "{name} is very organized and always double checks the totals.",
    "{Pron} wants to finish before dinner so that there is time to relax in the evening.",
    "A neighbor mentioned that the same thing happened to them last spring.",
    "There are no taxes or extra fees to worry about.",
]


def _fmt(s: str, p: dict) -> str:
    return s.format(**p)


def _person(rng: random.Random, exclude=()) -> dict:
    name, pron = rng.choice([n for n in NAMES if n[0] not in exclude])
    return {"name": name, "pron": pron, "Pron": pron.capitalize(), "poss": "her" if pron == "she" else "his",
            "obj": "her" if pron == "she" else "him"}


def _sales(rng, p):
    a, k, b = rng.randint(12, 60), rng.randint(2, 4), rng.randint(3, 15)
    pl, place = rng.choice(GOODS), rng.choice(PLACES)
    t = a * k
    w = t - b
    total = a + t + w
    q = (f"{p['name']} sells {pl} at the {place} every week. On Monday {p['pron']} sold {a} {pl}. On Tuesday "
         f"{p['pron']} sold {k} times as many {pl} as on Monday, and on Wednesday {p['pron']} sold {b} fewer "
         f"than on Tuesday. How many {pl} did {p['name']} sell in total over the three days?")
    steps = [f"On Tuesday {p['pron']} sold {a} * {k} = <<{a}*{k}={t}>>{t} {pl}.",
             f"On Wednesday {p['pron']} sold {t} - {b} = <<{t}-{b}={w}>>{w} {pl}.",
             f"In total {p['pron']} sold {a} + {t} + {w} = <<{a}+{t}+{w}={total}>>{total} {pl}."]
    return q, steps, total


def _wage(rng, p):
    w, h, b = rng.randint(9, 30), rng.randint(8, 40), rng.choice([20, 25, 40, 50, 75, 100])
    e = rng.randint(15, 120)
    pay, tot = w * h, w * h + b
    left = tot - e
    job = rng.choice(JOBS)
    exp = rng.choice(EXPENSES).replace("her", p["poss"])
    q = (f"{p['name']} works as a {job} and earns ${w} an hour. This week {p['pron']} worked {h} hours, and "
         f"{p['pron']} also received a bonus of ${b} for doing a great job. After paying ${e} for {exp}, how "
         f"much money does {p['name']} have left from this week's earnings?")
    steps = [f"{p['name']} earned {w} * {h} = $<<{w}*{h}={pay}>>{pay} for the hours worked.",
             f"With the bonus {p['pron']} had {pay} + {b} = $<<{pay}+{b}={tot}>>{tot}.",
             f"After paying for {exp} {p['pron']} has {tot} - {e} = $<<{tot}-{e}={left}>>{left} left."]
    return q, steps, left


def _shopping(rng, p):
    (t1, t2), ev = rng.choice(THINGS), rng.choice(EVENTS)
    n1, p1, n2, p2 = rng.randint(2, 9), rng.randint(2, 15), rng.randint(2, 9), rng.randint(1, 12)
    c1, c2 = n1 * p1, n2 * p2
    cost = c1 + c2
    bill = rng.choice([20, 50, 100])
    k = cost // bill + 1
    paid = k * bill
    change = paid - cost
    q = (f"{p['name']} goes to the store to buy supplies for {ev}. {p['Pron']} buys {n1} {t1} that cost ${p1} "
         f"each and {n2} {t2} that cost ${p2} each. If {p['pron']} pays with {k} ${bill} bills, how much change "
         f"does {p['pron']} get back?")
    steps = [f"The {t1} cost {n1} * {p1} = $<<{n1}*{p1}={c1}>>{c1}.",
             f"The {t2} cost {n2} * {p2} = $<<{n2}*{p2}={c2}>>{c2}.",
             f"Altogether {p['pron']} spends {c1} + {c2} = $<<{c1}+{c2}={cost}>>{cost}.",
             f"{p['Pron']} pays {k} * {bill} = $<<{k}*{bill}={paid}>>{paid}.",
             f"So {p['pron']} gets {paid} - {cost} = $<<{paid}-{cost}={change}>>{change} back."]
    return q, steps, change


def _savings(rng, p):
    goal, src = rng.choice(GOALS), rng.choice(SOURCES).replace("her", p["poss"]).replace("his", p["poss"])
    w, n, s = rng.choice([5, 8, 10, 12, 15, 20, 25]), rng.randint(3, 20), rng.randint(10, 150)
    c = s + w * n
    need = c - s
    q = (f"{p['name']} wants to buy a new {goal} that costs ${c}. {p['Pron']} already has ${s} saved, and "
         f"{p['pron']} earns ${w} every week from {src}. If {p['pron']} saves all of it, how many weeks will it "
         f"take {p['name']} to have enough money to buy the {goal}?")
    steps = [f"{p['Pron']} still needs {c} - {s} = $<<{c}-{s}={need}>>{need}.",
             f"That takes {need} / {w} = <<{need}/{w}={n}>>{n} weeks."]
    return q, steps, n


def _travel(rng, p):
    rel = rng.choice(RELATIVES)
    v1, t1 = rng.choice([40, 45, 50, 55, 60, 65]), rng.randint(1, 5)
    v2, t2 = rng.choice([30, 35, 40, 50, 60]), rng.randint(1, 4)
    d1, d2 = v1 * t1, v2 * t2
    tot = d1 + d2
    q = (f"{p['name']} drives to visit {p['poss']} {rel}. {p['Pron']} drives at {v1} miles per hour for {t1} "
         f"hours, then stops for lunch. After lunch {p['pron']} drives at {v2} miles per hour for another {t2} "
         f"hours to arrive. How many miles did {p['name']} drive in total?")
    steps = [f"Before lunch {p['pron']} drove {v1} * {t1} = <<{v1}*{t1}={d1}>>{d1} miles.",
             f"After lunch {p['pron']} drove {v2} * {t2} = <<{v2}*{t2}={d2}>>{d2} miles.",
             f"In total {p['pron']} drove {d1} + {d2} = <<{d1}+{d2}={tot}>>{tot} miles."]
    return q, steps, tot


def _sharing(rng, p):
    (treat, box), rel = rng.choice(TREATS), rng.choice(RELATIVES)
    k, each = rng.randint(2, 8), rng.randint(2, 12)
    a, b = rng.randint(1, 9), rng.randint(2, 15)
    n = k * each + a + b
    rest = n - a - b
    q = (f"A {box} holds {n} {treat}s. {p['name']} eats {a} of them and gives {b} to {p['poss']} {rel}. "
         f"{p['Pron']} wants to share the rest equally among {k} friends. How many {treat}s does each "
         f"friend get?")
    steps = [f"{p['Pron']} eats and gives away {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {treat}s.",
             f"That leaves {n} - {a + b} = <<{n}-{a + b}={rest}>>{rest} {treat}s.",
             f"Each friend gets {rest} / {k} = <<{rest}/{k}={each}>>{each} {treat}s."]
    return q, steps, each


def _discount(rng, p):
    prod = rng.choice(PRODUCTS)
    d = rng.choice([10, 20, 25, 30, 40, 50])
    price = rng.randint(2, 30) * 20
    q_ = rng.randint(2, 6)
    off = price * d // 100
    sale = price - off
    tot = sale * q_
    if prod.startswith("pair of"):
        plural = prod.replace("pair of", "pairs of")
    else:
        plural = prod + ("es" if prod.endswith("ch") else "s")
    q = (f"A {prod} normally costs ${price} at the store where {p['name']} shops. This weekend the store is "
         f"having a sale and takes {d}% off the regular price. {p['name']} decides to buy {q_} {plural} during "
         f"the sale. How much does {p['name']} pay in total?")
    steps = [f"The discount is {price} * {d} / 100 = $<<{price}*{d}/100={off}>>{off}.",
             f"So one costs {price} - {off} = $<<{price}-{off}={sale}>>{sale} on sale.",
             f"{p['name']} pays {sale} * {q_} = $<<{sale}*{q_}={tot}>>{tot}."]
    return q, steps, tot


def _ages(rng, p):
    b = _person(rng, (p["name"],))
    c = _person(rng, (p["name"], b["name"]))
    x, k = rng.randint(3, 15), rng.randint(2, 4)
    bx = k * x
    y = rng.randint(1, bx - 1)
    cx = bx - y
    tot = x + bx + cx
    q = (f"{p['name']} is {x} years old. {b['name']} is {k} times as old as {p['name']}, and {c['name']} is "
         f"{y} years younger than {b['name']}. What is the sum of the ages of {p['name']}, {b['name']} and "
         f"{c['name']}?")
    steps = [f"{b['name']} is {x} * {k} = <<{x}*{k}={bx}>>{bx} years old.",
             f"{c['name']} is {bx} - {y} = <<{bx}-{y}={cx}>>{cx} years old.",
             f"Together they are {x} + {bx} + {cx} = <<{x}+{bx}+{cx}={tot}>>{tot} years old."]
    return q, steps, tot


def _garden(rng, p):
    plant = rng.choice(PLANTS)
    qd = rng.choice([2, 3, 4, 5])
    r, per = rng.randint(3, 12), rng.randint(4, 15)
    while (r * per) % qd:
        per += 1
    n = r * per
    lost = n // qd
    left = n - lost
    extra = rng.randint(0, 10)
    fin = left + extra
    frac = {2: "half", 3: "one third", 4: "one quarter", 5: "one fifth"}[qd]
    q = (f"{p['name']} plants a garden with {r} rows of {plant} plants, with {per} plants in each row. A storm "
         f"damages {frac} of the plants, and {p['pron']} has to pull them out. Later {p['pron']} buys {extra} "
         f"new {plant} plants and adds them to the garden. How many {plant} plants are in the garden now?")
    steps = [f"{p['Pron']} planted {r} * {per} = <<{r}*{per}={n}>>{n} plants.",
             f"The storm damaged {n} / {qd} = <<{n}/{qd}={lost}>>{lost} plants.",
             f"That left {n} - {lost} = <<{n}-{lost}={left}>>{left} plants.",
             f"Now there are {left} + {extra} = <<{left}+{extra}={fin}>>{fin} plants."]
    return q, steps, fin


def _reading(rng, p):
    a, c, days = rng.randint(10, 40), rng.randint(10, 30), rng.randint(2, 12)
    first = 3 * a
    P = first + c * days
    rest = P - first
    q = (f"{p['name']} is reading a book that has {P} pages. On the first day {p['pron']} reads {a} pages, and on "
         f"the second day {p['pron']} reads twice as many pages as on the first day. If {p['pron']} reads {c} "
         f"pages every day after that, how many more days will it take {p['obj']} to finish the book?")
    steps = [f"On the second day {p['pron']} reads {a} * 2 = <<{a}*2={2 * a}>>{2 * a} pages.",
             f"After two days {p['pron']} has read {a} + {2 * a} = <<{a}+{2 * a}={first}>>{first} pages.",
             f"{P} - {first} = <<{P}-{first}={rest}>>{rest} pages are left.",
             f"It takes {rest} / {c} = <<{rest}/{c}={days}>>{days} more days."]
    return q, steps, days


def _classroom(rng, p):
    f = rng.choice([25, 40, 50, 60, 75])
    n = rng.choice([20, 24, 28, 32, 36, 40])
    while (n * f) % 100 or (n - n * f // 100) % 2:
        n += 4
    g = n * f // 100
    boys = n - g
    half = boys // 2
    q = (f"There are {n} students in {p['name']}'s class. {f}% of the students are girls and the rest are boys. "
         f"Half of the boys signed up for the soccer team this year. How many boys in {p['name']}'s class "
         f"signed up for the soccer team?")
    steps = [f"There are {n} * {f} / 100 = <<{n}*{f}/100={g}>>{g} girls.",
             f"So there are {n} - {g} = <<{n}-{g}={boys}>>{boys} boys.",
             f"Half of them is {boys} / 2 = <<{boys}/2={half}>>{half} boys."]
    return q, steps, half


def _legs(rng, p):
    (a1, l1), (a2, l2) = rng.sample(ANIMALS, 2)
    n1, n2, k = rng.randint(3, 30), rng.randint(2, 20), rng.randint(1, 8)
    m2 = n2 + k
    s1, s2 = n1 * l1, m2 * l2
    tot = s1 + s2
    q = (f"On {p['name']}'s farm there are {n1} {a1} and {n2} {a2}. At the market {p['name']} buys {k} more "
         f"{a2} and brings them home to the farm. How many legs do all the {a1} and {a2} on the farm have "
         f"together now?")
    steps = [f"There are now {n2} + {k} = <<{n2}+{k}={m2}>>{m2} {a2}.",
             f"The {a1} have {n1} * {l1} = <<{n1}*{l1}={s1}>>{s1} legs.",
             f"The {a2} have {m2} * {l2} = <<{m2}*{l2}={s2}>>{s2} legs.",
             f"Together they have {s1} + {s2} = <<{s1}+{s2}={tot}>>{tot} legs."]
    return q, steps, tot


def _factory(rng, p):
    item = rng.choice(FACTORY)
    per, h, d = rng.randint(10, 90), rng.randint(4, 12), rng.randint(2, 7)
    bad = rng.randint(5, 60)
    day = per * h
    tot = day * d
    good = tot - bad
    q = (f"{p['name']} manages a small factory that makes {item}. The machines make {per} {item} every hour, "
         f"and the factory runs for {h} hours each day. This week the factory was open for {d} days, and {bad} "
         f"of the {item} had to be thrown away. How many good {item} did the factory make this week?")
    steps = [f"Each day the factory makes {per} * {h} = <<{per}*{h}={day}>>{day} {item}.",
             f"In {d} days it makes {day} * {d} = <<{day}*{d}={tot}>>{tot} {item}.",
             f"The good ones are {tot} - {bad} = <<{tot}-{bad}={good}>>{good}."]
    return q, steps, good


def _money_fraction(rng, p):
    a = rng.choice([2, 3, 4, 5])
    m = rng.randint(4, 40) * a * 5
    part = m // a
    b = rng.randint(3, max(4, (m - part) // 2))
    left = m - part - b
    x, y = rng.sample(["books", "a sweater", "snacks", "a concert ticket", "art supplies", "a gift", "plants"], 2)
    q = (f"{p['name']} had ${m} in {p['poss']} wallet at the start of the day. {p['Pron']} spent 1/{a} of the "
         f"money on {x} and then spent ${b} on {y}. How much money does {p['name']} have left at the end of "
         f"the day?")
    steps = [f"{p['Pron']} spent {m} / {a} = $<<{m}/{a}={part}>>{part} on {x}.",
             f"{p['Pron']} spent {part} + {b} = $<<{part}+{b}={part + b}>>{part + b} in total.",
             f"{p['Pron']} has {m} - {part + b} = $<<{m}-{part + b}={left}>>{left} left."]
    return q, steps, left


FAMILIES = [_sales, _wage, _shopping, _savings, _travel, _sharing, _discount, _ages, _garden, _reading,
            _classroom, _legs, _factory, _money_fraction]


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    """``n`` GSM8K-shaped rows: a word problem of 40-120 words, step lines, ``#### <integer>``."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        p = _person(rng)
        q, steps, ans = rng.choice(FAMILIES)(rng, p)
        if ans <= 0:
            continue
        target = min(120, int(rng.triangular(40, 120, 45)))
        ctx = rng.sample(CONTEXT, len(CONTEXT))
        lead, tail = [], []
        while len(" ".join([*lead, q, *tail]).split()) < target and ctx:
            raw = ctx.pop()
            s = _fmt(raw, p)
            # a sentence that opens with a pronoun only after the question has named the person
            (lead if rng.random() < 0.6 and "ron}" not in raw else tail).append(s)
            if len(" ".join([*lead, q, *tail]).split()) > 120:
                (lead if lead and lead[-1] == s else tail).pop()
                break
        if tail:  # the question sentence stays last
            body, ask = q.rsplit(". ", 1)
            q = " ".join([*lead, body + ".", *tail, ask])
        else:
            q = " ".join([*lead, q])
        words = len(q.split())
        if not 40 <= words <= 120:
            continue
        rows.append({"question": q, "answer": "\n".join(steps) + f"\n#### {ans}"})
    return rows


def write_raw(rows: list[dict], dest: Path) -> bool:
    """Write the ``openai/gsm8k``-style parquet (columns question, answer); False if unchanged."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    schema = pa.schema([("question", pa.string()), ("answer", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf)
    data = buf.getvalue()
    if dest.is_file() and dest.read_bytes() == data:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, dest)
    return True


def build_data(out: Path, record: Record, force: bool) -> None:
    ddir = out / "data"
    if force and ddir.exists():
        shutil.rmtree(ddir)
    ddir.mkdir(parents=True, exist_ok=True)
    rows = {"train": gsm8k_rows(TRAIN_ROWS, DATA_SEED), "test": gsm8k_rows(TEST_ROWS, DATA_SEED + 1)}
    for split, rel in RAW_FILES.items():
        if write_raw(rows[split], ddir / rel):
            log(f"data: wrote {rel} ({len(rows[split])} rows)")
    script = REPO / "verl_lab_box" / "gsm8k.py"  # the box's own preprocessing, run the way the box runs it
    py = sys.executable
    res = subprocess.run([py, str(script), "build", "--train", str(ddir / RAW_FILES["train"]),
                          "--test", str(ddir / RAW_FILES["test"]), "--out", str(ddir)],
                         check=True, capture_output=True, text=True)
    log("data: gsm8k.py build: " + res.stdout.strip())
    res = subprocess.run([py, str(script), "prove", "--out", str(ddir), "--train-rows", str(TRAIN_ROWS),
                          "--test-rows", str(TEST_ROWS), "--val-rows", str(VAL_ROWS)],
                         check=True, capture_output=True, text=True)
    log("data: gsm8k.py prove: " + res.stdout.strip())
    words = sorted(len(r["question"].split()) for r in rows["train"] + rows["test"])
    record.put("data", {"train_seed": DATA_SEED, "test_seed": DATA_SEED + 1,
                        "question_words": {"min": words[0], "median": words[len(words) // 2], "max": words[-1]},
                        "files": {n: sha256_of(ddir / n) for n in gsm8k_module().OUTPUTS.values()}})


# --------------------------------------------------------------------------------- tokenizer

COMMON_WORDS = (
    "the of and to a in is it you that he was for on are with as I his they be at one have this from or had "
    "by hot word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two "
    "has look more day could go come did number sound no most people my over know water than call first who "
    "may down side been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell does set three "
    "want air well also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again animal point "
    "mother world near build self earth father head stand own page should country found answer school grow "
    "study still learn plant cover food sun four between state keep eye never last let thought city tree "
    "cross farm hard start might story saw far sea draw left late run don't while press close night real life "
    "few north open seem together next white children begin got walk example ease paper group always music "
    "those both mark often letter until mile river car feet care second book carry took science eat room "
    "friend began idea fish mountain stop once base hear horse cut sure watch color face wood main enough "
    "plain girl usual young ready above ever red list though feel talk bird soon body dog family direct pose "
    "leave song measure door product black short numeral class wind question happen complete ship area half "
    "rock order fire south problem piece told knew pass since top whole king space heard best hour better "
    "true during hundred five remember step early hold west ground interest reach fast verb sing listen six "
    "table travel less morning ten simple several vowel toward war lay against pattern slow center love "
    "person money serve appear road map rain rule govern pull cold notice voice unit power town fine certain "
    "fly fall lead cry dark machine note wait plan figure star box noun field rest correct able pound done "
    "beauty drive stood contain front teach week final gave green oh quick develop ocean warm free minute "
    "strong special mind behind clear tail produce fact street inch multiply nothing course stay wheel full "
    "force blue object decide surface deep moon island foot system busy test record boat common gold possible "
    "plane stead dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire bring "
    "yes distant fill east paint language among total price cost dollar cent percent twice half third quarter "
    "each per sum difference product divide times more less fewer remaining left altogether equally share"
).split()


def tokenizer_corpus() -> list[str]:
    """A few MB of English-like text: GSM8K-shaped rows (another seed than the data) + common words."""
    rows = gsm8k_rows(CORPUS_ROWS, CORPUS_SEED)
    rng = random.Random(CORPUS_SEED)
    system = "system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n"
    instruction = gsm8k_module().INSTRUCTION
    # half the rows as verl prompts (system prompt, question + the preprocessing's instruction) so
    # that those frequent strings get merged as a real Qwen vocabulary has them
    texts = [(system + "user\n" + r["question"] + " " + instruction + "\nassistant\n" if i % 2 else "")
             + r["question"] + "\n" + r["answer"] for i, r in enumerate(rows)]
    for _ in range(4000):
        words = [rng.choice(COMMON_WORDS) for _ in range(rng.randint(8, 24))]
        words[0] = words[0].capitalize()
        texts.append(" ".join(words) + rng.choice([".", "?", "!", ",", ";"]) + rng.choice([" ", "\n", "\n\n"]))
    texts.append(" ".join(COMMON_WORDS))
    texts.append(" ".join(w.capitalize() for w in COMMON_WORDS))
    return texts


def make_tokenizer(corpus: list[str]):
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=REGULAR_TOKENS, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(corpus, trainer=trainer)
    trained = tok.get_vocab_size()
    # fill the vocabulary up to exactly REGULAR_TOKENS with never-produced tokens (no merge yields them)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    if len(vocab) > REGULAR_TOKENS or sorted(vocab.values()) != list(range(len(vocab))):
        raise SystemExit(f"payload: trained vocabulary is not ids 0..{len(vocab) - 1}")
    i = 0
    while len(vocab) < REGULAR_TOKENS:
        filler = f"<fill{i}>"
        if filler not in vocab:
            vocab[filler] = len(vocab)
        i += 1
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False,
                                       single_word=False) for t in SPECIALS])
    return tok, trained


def prove_tokenizer(path: Path) -> dict:
    """Load tokenizer.json with ``tokenizers`` alone: ids, size, round trip, chat pieces."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    facts = {"vocab_size": tok.get_vocab_size(with_added_tokens=True),
             "regular": tok.get_vocab_size(with_added_tokens=False)}
    if facts["vocab_size"] != REGULAR_TOKENS + len(SPECIALS) or facts["regular"] != REGULAR_TOKENS:
        raise SystemExit(f"payload: tokenizer sizes {facts}, expected {REGULAR_TOKENS} + {len(SPECIALS)}")
    for t, want in SPECIALS.items():
        if tok.token_to_id(t) != want:
            raise SystemExit(f"payload: {t} has id {tok.token_to_id(t)}, expected {want}")
    sample = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
              "How many clips did Natalia sell altogether in April and May?\n  Tabs\tand   spaces, "
              "ünïcödé, 日本語, emoji 🙂, $1,234.50 & 12% off!\n\n#### 72")
    ids = tok.encode(sample).ids
    if tok.decode(ids) != sample:
        raise SystemExit("payload: tokenizer round trip failed")
    chat = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok.encode(chat).ids
    if chat_ids[0] != SPECIALS["<|im_start|>"] or SPECIALS["<|im_end|>"] not in chat_ids:
        raise SystemExit(f"payload: special tokens are not matched whole in {chat_ids}")
    if tok.decode(chat_ids, skip_special_tokens=False) != chat:
        raise SystemExit("payload: chat round trip failed")
    facts["sample_tokens"] = len(ids)
    facts["sample_chars"] = len(sample)
    return facts


def build_tokenizer(out: Path, record: Record, force: bool) -> None:
    tdir = out / "tokenizer"
    corpus = tokenizer_corpus()
    recipe = sha256_bytes(json.dumps({"corpus": sha256_bytes("\x00".join(corpus).encode()), "split": QWEN2_SPLIT,
                                      "regular": REGULAR_TOKENS, "specials": SPECIALS,
                                      "template": CHAT_TEMPLATE}, sort_keys=True).encode())
    have = record.get("tokenizer") or {}
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    if (not force and have.get("recipe") == recipe and all((tdir / n).is_file() for n in names)
            and all(sha256_of(tdir / n) == have["files"].get(n) for n in names)):
        facts = prove_tokenizer(tdir / "tokenizer.json")
        log(f"tokenizer: unchanged ({facts['vocab_size']} tokens)")
        return
    log(f"tokenizer: training a byte-level BPE on {mib(sum(len(t.encode()) for t in corpus))} of text")
    tok, trained = make_tokenizer(corpus)
    if tdir.exists():
        shutil.rmtree(tdir)
    tdir.mkdir(parents=True)
    tok.save(str(tdir / "tokenizer.json"), pretty=False)
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for t, i in SPECIALS.items()}
    config = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
        "errors": "replace", "model_max_length": 32768, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2TokenizerFast", "unk_token": None,
    }
    (tdir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                   "eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False},
                   "pad_token": {"content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False}}
    (tdir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    facts = prove_tokenizer(tdir / "tokenizer.json")
    facts["trained"] = trained
    record.put("tokenizer", {"recipe": recipe, "facts": facts, "files": {n: sha256_of(tdir / n) for n in names}})
    log(f"tokenizer: {trained} trained tokens, filled to {REGULAR_TOKENS}, + {len(SPECIALS)} special = "
        f"{facts['vocab_size']}; sample {facts['sample_chars']} chars -> {facts['sample_tokens']} tokens, "
        "round trip ok")


# -------------------------------------------------------------------------------------- main

def parse_trees(specs: list[str]) -> list[tuple[str, str]]:
    out = []
    for spec in specs:
        name, sep, ref = spec.partition("=")
        if not sep or not name or not ref or not name.replace("-", "").replace("_", "").isalnum():
            raise SystemExit(f"payload: --verl-tree {spec!r}: expected NAME=REF (NAME letters, digits, - _)")
        out.append((name, ref))
    return out


def report(out: Path) -> int:
    parts = [("wheels/", out / "wheels"), (f"{RAY[0]}-{RAY[1]}.tar.xz", out / f"{RAY[0]}-{RAY[1]}.tar.xz"),
             ("verl/", out / "verl"), ("tokenizer/", out / "tokenizer"), ("data/", out / "data")]
    print(f"\n{'part':<28}{'size':>12}")
    for label, path in parts:
        print(f"{label:<28}{mib(tree_size(path)) if path.exists() else '-':>12}")
        if label == "wheels/" and path.is_dir():
            for w in sorted(path.iterdir()):
                print(f"  {w.name:<70}{w.stat().st_size / 1e6:>8.2f} MB")
        if label == "verl/" and path.is_dir():
            for t in sorted(path.glob("*.tar.xz")):
                print(f"  {t.name:<26}{mib(t.stat().st_size):>12}")
    total = tree_size(out)
    print(f"{str(out) + '/ in all':<28}{mib(total):>12}  (limit {LIMIT_MIB} MiB)")
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / ".gpu")
    ap.add_argument("--verl-tree", action="append", metavar="NAME=REF",
                    help=f"repeatable; default: {' '.join(DEFAULT_TREES)}")
    ap.add_argument("--verl-sdist", type=Path, default=DEFAULT_SDIST,
                    help="the verl 0.5.0 sdist (downloaded into --cache when absent)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="downloads, outside the payload")
    ap.add_argument("--pip-python", default="python3", help="the python whose pip downloads and builds wheels")
    ap.add_argument("--force", action="store_true", help="rebuild every part")
    args = ap.parse_args(argv)
    trees = []  # resolved first: a wrong ref fails before anything is downloaded
    for name, ref in parse_trees(args.verl_tree or list(DEFAULT_TREES)):
        commit, patches = patch_set(ref)
        if not patches:
            raise SystemExit(f"payload: no {PATCH_DIR}/*.diff as of {ref}")
        trees.append((name, ref, commit, patches))
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    record = Record(out / "build.json")
    build_wheels(out, args.cache, record, args.pip_python, args.force)
    build_ray(out, args.cache, record, args.pip_python, args.force)
    sdist = verl_sdist(args.verl_sdist, args.cache, args.pip_python)
    for name, ref, commit, patches in trees:
        build_verl_tree(out, name, ref, commit, patches, sdist, record, args.force)
        for mutation in BURNIN_MUTATIONS if name == "current" else ():
            build_verl_tree(out, f"current-{mutation}", ref, commit,
                            [*patches, (f"{mutation}.diff", (MUTATIONS / f"{mutation}.diff").read_bytes())], sdist,
                            record, args.force)
    build_data(out, record, args.force)
    build_tokenizer(out, record, args.force)
    total = report(out)
    if total > LIMIT_MIB * 2**20:
        print(f"payload: {out} is {mib(total)}, over {LIMIT_MIB} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
