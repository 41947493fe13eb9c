"""verl-lab: prove a Python env (run by that env's python). Prints one JSON object.

    python env-prove.py '<json expectations>'

Expectations: torch (pinned version), cuda ("11.8", or "none" for a CPU torch stand-in),
gpu_cc ("6.1" or null), vllm (version expected, or null with vllm_skip saying why), xformers
(version expected, or null with xformers_skip), xformers_cuda (the build expected, "11.8"),
xformers_index (where that build comes from, for the fix), verl (version), verl_src, compose
(bool) and overrides (Hydra overrides for the compose check).
Every check is reported as {"ok": true|false, "detail": "..."}; a skipped check is ok and its
detail starts with "skipped:".

lock (the plan's pinned ``name==version`` lines) and the modules verl's trainer loads are checked in
both modes, without importing them (env_lock.py, this program's sibling: beside it in the repo and
in the box's env-build/, or sent ahead of it in one program by the PythonEnv fact): every pin
installed at its version and everything the pins and verl need installed at a version they accept,
and every module the trainer's top-level imports reach found on the path.

With "quick": true (the re-check of an env that passed every proof when it was built from the
same plan) nothing heavy is imported: versions come from the installed metadata, Apex's
extensions and verl's patched source are located on disk, and every installed file is checked
against its package's RECORD (present, recorded size), which finds deleted or truncated files
and swapped versions; the lock and the imports find what was uninstalled (a package whose files
and RECORD went together) — all in well under a second (bench/env_quick_check.py). The imports
themselves, the GPU and the config compose are proven at build time, by deploy/rebuild.py, and
with env_health_check=full.
"""

import importlib
import importlib.util
import json
import os
import subprocess
import sys

try:
    import env_lock
except ImportError:   # sent in one program with it (tasks/facts/env.py): its names are this module's
    env_lock = sys.modules[__name__]

want = json.loads(sys.argv[1])
checks = {}
QUICK = bool(want.get("quick"))
QUICK_SKIP = "skipped: quick re-check (proven when this env was built)"


def check(name):
    def wrap(fn):
        try:
            ok, detail = fn()
        except BaseException as exc:  # an import failing is the answer, not a crash
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        checks[name] = {"ok": bool(ok), "detail": str(detail)[:500]}
        return fn
    return wrap


same_version = env_lock.same_version


def installed_records():
    """(distribution name, folder, RECORD path) of every installed wheel on sys.path.

    Read straight from ``*.dist-info/RECORD`` (importlib.metadata builds a path object per
    file: several times slower on torch's ~15,000 files). A folder met twice (a symlinked
    path) is read once.
    """
    seen = set()
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        real = os.path.realpath(entry)
        if real in seen:
            continue
        seen.add(real)
        for name in sorted(os.listdir(entry)):
            record = os.path.join(entry, name, "RECORD")
            if name.endswith(".dist-info") and os.path.isfile(record):
                yield name[: -len(".dist-info")].rsplit("-", 1)[0], entry, record


def record_problems():
    """(files checked, problems): each recorded file present with its recorded size."""
    import csv

    bad, seen = [], 0
    for dist, folder, record in installed_records():
        with open(record, newline="", encoding="utf-8") as fh:
            for row in csv.reader(fh):
                # bytecode may be rewritten by any later import; the sources it comes from are checked
                if len(row) < 3 or not row[2].isdigit() or row[0].endswith(".pyc"):
                    continue
                seen += 1
                try:
                    if os.stat(os.path.join(folder, row[0])).st_size != int(row[2]):
                        bad.append(f"{dist}: {row[0]} has another size than recorded")
                except OSError:
                    bad.append(f"{dist}: {row[0]} is missing")
    return seen, bad


@check("files")
def _files():
    seen, bad = record_problems()
    if bad:
        return False, f"{len(bad)} of {seen} installed files differ from their RECORD: " + "; ".join(bad[:4])
    return True, f"{seen} installed files present with their recorded sizes"


@check("lock")
def _lock():
    if want.get("lock") is None:
        return True, "skipped: no lock given"
    roots = ["verl"] + (["vllm"] if want.get("vllm") else [])
    count, bad = env_lock.lock_problems(want["lock"], roots)
    if bad:
        return False, f"{len(bad)} of {count} distributions differ from the lock: {env_lock.shown(bad)}"
    return True, f"{count} distributions as the lock pins them and as each other need (not imported)"


@check("imports")
def _imports():
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return False, "No module named 'verl'"
    root = os.path.dirname(list(spec.submodule_search_locations)[0])
    count, bad = env_lock.import_problems(root)
    if bad:
        return False, f"verl's trainer would not load: {env_lock.shown(bad)}"
    return True, f"every module verl's trainer imports when it loads is there ({count} of verl's read, not imported)"


def quick_version(dist, pin, what):
    from importlib import metadata

    have = metadata.version(dist)
    return same_version(have, pin), f"{what} {have} installed (pinned {pin}; quick re-check: not imported)"


@check("torch")
def _torch():
    if QUICK:
        return quick_version("torch", want["torch"], "torch")
    import torch
    return same_version(torch.__version__, want["torch"]), f"torch {torch.__version__} (pinned {want['torch']})"


@check("torch_cuda")
def _torch_cuda():
    if QUICK:
        return True, QUICK_SKIP
    import torch
    have = torch.version.cuda
    if want["cuda"] == "none":
        return have is None, f"CPU torch stand-in: torch.version.cuda is {have!r}, expected None"
    return have == want["cuda"], f"torch.version.cuda {have!r}, expected {want['cuda']!r}"


@check("gpu")
def _gpu():
    if QUICK:
        return True, QUICK_SKIP
    import torch
    if not want.get("gpu_cc"):
        return True, "skipped: the box has no usable NVIDIA GPU"
    if want["cuda"] == "none":
        return True, f"skipped: CPU torch stand-in (the box reports compute capability {want['gpu_cc']})"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False on a box with an NVIDIA GPU"
    major, minor = want["gpu_cc"].split(".")
    archs = torch.cuda.get_arch_list()
    exact = f"sm_{major}{minor}"
    if exact in archs:
        return True, f"{exact} in {archs}"
    # same-major fallback: sm_61 runs sm_60 code
    fallback = [a for a in archs if a.startswith(f"sm_{major}") and int(a[len(f"sm_{major}"):] or 0) <= int(minor)]
    if fallback:
        return True, f"{exact} runs {fallback[-1]} code (same major) from {archs}"
    return False, f"neither {exact} nor a same-major lower arch in {archs}"


@check("apex")
def _apex():
    names = ("amp_C", "fused_layer_norm_cuda", "apex_C")
    for name in names:
        if QUICK:  # locate the extension's file without loading it
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.origin or not os.path.isfile(spec.origin):
                return False, f"No module named {name!r} (its extension file is missing)"
            continue
        importlib.import_module(name)
    return True, "imported " + ", ".join(names)


@check("vllm")
def _vllm():
    if not want.get("vllm"):
        return True, f"skipped: {want.get('vllm_skip') or 'not planned'}"
    if QUICK:
        return quick_version("vllm", want["vllm"], "vllm")
    import vllm
    return same_version(vllm.__version__, want["vllm"]), f"vllm {vllm.__version__}"


def xformers_build(folder):
    """The build an installed xformers says it is (its xformers/cpp_lib.json): (cuda "11.8" or
    None, a description naming it)."""
    try:
        with open(os.path.join(folder, "cpp_lib.json")) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as exc:
        return None, f"a build without cpp_lib.json ({type(exc).__name__})"
    version = meta.get("version") or {}
    number = version.get("cuda")
    cuda = f"{number // 100}.{number % 100}" if isinstance(number, int) else None
    made = (meta.get("env") or {}).get("XFORMERS_PACKAGE_FROM")
    return cuda, (f"the CUDA {cuda or '?'} build for torch {version.get('torch', '?')}"
                  + (f", {made}" if made else ""))


def xformers_fix():
    return ("rebuild the env (deploy/rebuild.py), or in it: python -m pip install --no-deps --force-reinstall"
            f" --index-url {want.get('xformers_index') or '<the PyTorch cu118 index>'} xformers=={want['xformers']}")


@check("xformers")
def _xformers():
    # vLLM 0.8.5 pins xformers==0.0.29.post2; PyPI's file of that name is a CUDA 12.4 build
    # whose compiled ops cannot load beside torch cu118, the cu118 index's is the one planned.
    if not want.get("xformers"):
        return True, f"skipped: {want.get('xformers_skip') or 'not planned'}"
    expect_cuda = want.get("xformers_cuda")
    if QUICK:  # version from the metadata, the build from cpp_lib.json: nothing imported
        from importlib import metadata

        have = metadata.version("xformers")
        spec = importlib.util.find_spec("xformers")
        if spec is None or not spec.submodule_search_locations:
            return False, "No module named 'xformers'"
        cuda, build = xformers_build(list(spec.submodule_search_locations)[0])
        if not same_version(have, want["xformers"]):
            return False, f"xformers {have} ({build}), pinned {want['xformers']}: {xformers_fix()}"
        if expect_cuda and cuda != expect_cuda:
            return False, f"xformers {have} is {build}; expected the CUDA {expect_cuda} build: {xformers_fix()}"
        return True, f"xformers {have} ({build}; quick re-check: not imported)"
    import xformers
    folder = os.path.dirname(xformers.__file__)
    cuda, build = xformers_build(folder)
    have = getattr(xformers, "__version__", "?")
    if not same_version(have, want["xformers"]):
        return False, f"xformers {have} ({build}), pinned {want['xformers']}: {xformers_fix()}"
    # real xformers sets _has_cpp_library when torch.ops.load_library(xformers/_C.so) succeeded
    if not getattr(xformers, "_has_cpp_library", False):
        why = getattr(getattr(xformers, "_cpp_lib", None), "_cpp_library_load_exception", None)
        why = str(why).strip().splitlines()[0][:120] if why else "no reason given"
        return False, (f"xformers {have} is {build}: its compiled ops do not load (xformers._has_cpp_library is"
                       f" False: {why}); vLLM's V0 engine attends with them: {xformers_fix()}")
    if expect_cuda and cuda != expect_cuda:
        return False, f"xformers {have} is {build}; expected the CUDA {expect_cuda} build: {xformers_fix()}"
    return True, f"xformers {have} ({build}): compiled ops loaded"


def _verl_quick():
    from importlib import metadata

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.origin:
        return False, "No module named 'verl'"
    where = os.path.realpath(os.path.dirname(spec.origin))
    src = os.path.realpath(want["verl_src"])
    if not where.startswith(src + os.sep):
        return False, f"verl found at {where}, not under {src}"
    have = metadata.version("verl")
    if have != want["verl"]:
        return False, f"verl {have}, expected {want['verl']}"
    patched = os.path.join(where, "utils", "torch_dtypes.py")
    with open(patched) as fh:
        if "def autocast_dtype_of" not in fh.read():
            return False, f"{patched} lacks autocast_dtype_of: a project patch is not applied"
    return True, f"verl {have} at {where} (patched; quick re-check: not imported)"


@check("verl")
def _verl():
    if QUICK:
        return _verl_quick()
    import verl
    where = os.path.realpath(os.path.dirname(verl.__file__))
    src = os.path.realpath(want["verl_src"])
    if not where.startswith(src + os.sep):
        return False, f"verl imported from {where}, not from {src}"
    if verl.__version__ != want["verl"]:
        return False, f"verl {verl.__version__}, expected {want['verl']}"
    from verl.utils.torch_dtypes import autocast_dtype_of  # noqa: F401  (a project patch)
    return True, f"verl {verl.__version__} from {where} (patched)"


@check("compose")
def _compose():
    if QUICK:
        return True, QUICK_SKIP
    if not want.get("compose"):
        return True, "skipped: not asked"
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *want.get("overrides", []), "--cfg", "job"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd="/")
    if res.returncode != 0 or "actor_rollout_ref" not in res.stdout:
        return False, f"main_ppo --cfg job exit {res.returncode}: {(res.stderr or res.stdout)[-400:]}"
    return True, f"main_ppo --cfg job composed ({len(want.get('overrides', []))} overrides)"


broken = sorted(name for name, c in checks.items() if not c["ok"])
print(json.dumps({"healthy": not broken, "broken": broken, "checks": checks}, sort_keys=True))
