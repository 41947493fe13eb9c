"""The driver stage's pure decisions (behaviour, on plain values): the branch for every GPU generation
the catalog knows and for mixed boxes, the refusals, the apt sources it adds, install / hold / settle /
done on recorded box states (tests/fixtures/facts/driver.DriverState/), and the box-side verdicts.
The box program's steps and the reboot step are tested in tests/unit/test_driver_box.py."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from tasks.cuda import CudaFacts, cuda_want, plan_cuda
from tasks.driver import (
    Distro,
    DistroBranch,
    DriverFacts,
    GpuSeen,
    choose_branch,
    driver_want,
    gpus_seen,
    headers_packages,
    load_table,
    parse_sources,
    plan_driver,
    sources_to_add,
)
from tasks.facts.gpu import Gpu, GpuInventory
from tasks.plan import DOC_GPUS
from tasks.settings import RAY_UNIT, TRAIN_UNIT, load_settings
from tasks.target import decide_compiler
from tests.lab.gpus import GPUS
from verl_lab_box.nvidia_driver_state import JOB_UNIT, package_name, parse_fact_output, verdict

TABLE = load_table()
BOOKWORM = {"ID": "debian", "VERSION_ID": "12", "PRETTY_NAME": "Debian GNU/Linux 12 (bookworm)"}
JAMMY = {"ID": "ubuntu", "VERSION_ID": "22.04", "PRETTY_NAME": "Ubuntu 22.04.4 LTS"}
NOBLE = {"ID": "ubuntu", "VERSION_ID": "24.04", "PRETTY_NAME": "Ubuntu 24.04.1 LTS"}
DEBIAN, UBUNTU22, UBUNTU24 = (TABLE.distro(r) for r in (BOOKWORM, JAMMY, NOBLE))
CASES = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "driver.DriverState"
# a distro that also ships a branch past R580 (as archives will), to show where old GPUs stop
FUTURE = Distro("future", "1", "Future 1", ("main",), (
    DistroBranch(535, ("d-535",), "m-535", "s-535"), DistroBranch(580, ("d-580",), "m-580", "s-580"),
    DistroBranch(590, ("d-590",), "m-590", "s-590")))

# every GPU the catalog knows: the lab's stand-ins (tests/lab/gpus.py), docs/plan.md's table
# (tasks/plan/doc_tables.py DOC_GPUS), the A10 and L40S the project's GPU table also lists; plus Maxwell and Blackwell
CATALOG = sorted({(g.name, g.compute_cap) for g in GPUS.values()} | {(n, cc) for n, cc, _, _ in DOC_GPUS}
                 | {("NVIDIA A10", "8.6"), ("NVIDIA L40S", "8.9"), ("Tesla M40", "5.2"), ("NVIDIA B200", "10.0"),
                    ("NVIDIA GeForce RTX 5090", "12.0")})
ARCH = {"3.7": "Kepler", "5.2": "Maxwell", "6.0": "Pascal", "6.1": "Pascal", "7.0": "Volta", "7.5": "Turing",
        "8.0": "Ampere", "8.6": "Ampere", "8.9": "Ada Lovelace", "9.0": "Hopper", "10.0": "Blackwell",
        "12.0": "Blackwell"}


# The branch each GPU gets, written out by hand from NVIDIA's facts, not from the code's rule:
# (Debian 12, Ubuntu 22.04, Ubuntu 24.04, FUTURE). Kepler: R470 is its last, CUDA 11.8 needs R520;
# Blackwell: CUDA 11.8 has no code for it; the H200: R550 or newer (Debian 12 ships R535 alone);
# Maxwell, Pascal, Volta: R580 is their last (FUTURE's R590 drops them); Ubuntu ships R580 alone
# (its 535-server packages are wrappers that depend on 580-server).
EXPECTED = {
    ('NVIDIA A10', '8.6'): (535, 580, 580, 590),
    ('NVIDIA A100-SXM4-80GB', '8.0'): (535, 580, 580, 590),
    ('NVIDIA B200', '10.0'): (None, None, None, None),
    ('NVIDIA GeForce GTX 1080', '6.1'): (535, 580, 580, 580),
    ('NVIDIA GeForce GTX 1080 Ti', '6.1'): (535, 580, 580, 580),
    ('NVIDIA GeForce RTX 2070', '7.5'): (535, 580, 580, 590),
    ('NVIDIA GeForce RTX 2080 Ti', '7.5'): (535, 580, 580, 590),
    ('NVIDIA GeForce RTX 3060', '8.6'): (535, 580, 580, 590),
    ('NVIDIA GeForce RTX 3080', '8.6'): (535, 580, 580, 590),
    ('NVIDIA GeForce RTX 3090', '8.6'): (535, 580, 580, 590),
    ('NVIDIA GeForce RTX 4060', '8.9'): (535, 580, 580, 590),
    ('NVIDIA GeForce RTX 4090', '8.9'): (535, 580, 580, 590),
    ('NVIDIA GeForce RTX 5090', '12.0'): (None, None, None, None),
    ('NVIDIA H100 80GB HBM3', '9.0'): (535, 580, 580, 590),
    ('NVIDIA H200', '9.0'): (None, 580, 580, 590),
    ('NVIDIA L4', '8.9'): (535, 580, 580, 590),
    ('NVIDIA L40S', '8.9'): (535, 580, 580, 590),
    ('Tesla K80', '3.7'): (None, None, None, None),
    ('Tesla M40', '5.2'): (535, 580, 580, 580),
    ('Tesla P100-PCIE-16GB', '6.0'): (535, 580, 580, 580),
    ('Tesla P40', '6.1'): (535, 580, 580, 580),
    ('Tesla T4', '7.5'): (535, 580, 580, 590),
    ('Tesla V100-SXM2-16GB', '7.0'): (535, 580, 580, 580),
    ('Tesla V100-SXM2-32GB', '7.0'): (535, 580, 580, 580),
}


def expected(name: str, cc: str, distro: Distro) -> int | None:
    return EXPECTED[(name, cc)][[DEBIAN, UBUNTU22, UBUNTU24, FUTURE].index(distro)]


def test_the_catalog_covers_every_generation():
    from tasks.gpu_support import ARCHITECTURES

    assert {ARCH[cc] for _, cc in CATALOG} == {name for _, name, _ in ARCHITECTURES} - {"Fermi"}
    assert {cc for _, cc in CATALOG} <= set(ARCH)
    assert set(TABLE.chips.values()) == {name for _, name, _ in ARCHITECTURES}


@pytest.mark.parametrize("distro", [DEBIAN, UBUNTU22, UBUNTU24, FUTURE], ids=lambda d: d.name)
@pytest.mark.parametrize("name,cc", CATALOG)
def test_branch_for_every_gpu_the_catalog_knows(name, cc, distro):
    choice = choose_branch([GpuSeen(name, cc)], distro, TABLE, 520)
    want = expected(name, cc, distro)
    if want is None:
        assert choice.branch is None and choice.problems, choice
        return
    assert choice.branch is not None and choice.branch.branch == want, choice
    assert ARCH[cc] in choice.reason and f"{name} ({cc})" in choice.reason
    assert not choice.problems


def test_debian_12_and_ubuntu_give_their_own_packages():
    deb = choose_branch([GpuSeen("Tesla P40", "6.1")], DEBIAN, TABLE, 520).branch
    assert (deb.branch, deb.packages, deb.module_package, deb.source) == (
        535, ("nvidia-driver", "nvidia-smi", "libcuda1"), "nvidia-kernel-dkms", "nvidia-graphics-drivers")
    ub = choose_branch([GpuSeen("Tesla P40", "6.1")], UBUNTU24, TABLE, 520).branch
    assert (ub.branch, ub.packages, ub.module_package, ub.source) == (
        580, ("nvidia-headless-580-server", "nvidia-utils-580-server"), "nvidia-dkms-580-server",
        "nvidia-graphics-drivers-580-server")


@pytest.mark.parametrize("gpus,distro,branch", [
    ([("Tesla P40", "6.1"), ("NVIDIA GeForce RTX 3090", "8.6")], FUTURE, 580),      # Pascal holds the box at R580
    ([("Tesla T4", "7.5"), ("NVIDIA GeForce RTX 3090", "8.6")], FUTURE, 590),       # no old GPU: the newest
    ([("Tesla V100-SXM2-32GB", "7.0"), ("NVIDIA H100 80GB HBM3", "9.0")], FUTURE, 580),
    ([("NVIDIA H200", "9.0"), ("Tesla P40", "6.1")], UBUNTU22, 580),                # R550 .. R580: 580
    ([("NVIDIA H200", "9.0"), ("Tesla P40", "6.1")], DEBIAN, None),                 # Debian's R535 < R550
    ([("Tesla K80", "3.7"), ("Tesla T4", "7.5")], UBUNTU24, None),                  # Kepler refuses the box
    ([("NVIDIA B200", "10.0"), ("NVIDIA H100 80GB HBM3", "9.0")], UBUNTU24, None),  # CUDA 11.8 cannot run a B200
    ([("Tesla P40", "6.1"), ("Tesla P40", "6.1"), ("Tesla P40", "6.1")], DEBIAN, 535),
])
def test_mixed_boxes(gpus, distro, branch):
    choice = choose_branch([GpuSeen(n, cc) for n, cc in gpus], distro, TABLE, 520)
    assert (choice.branch.branch if choice.branch else None) == branch, choice
    if branch is None:                          # the GPU that no branch serves is named
        assert any(n in " ".join(choice.problems) for n, _ in gpus) and not choice.reason
    else:                                       # every GPU's reason is shown
        assert all(f"{name} ({cc})" in choice.reason for name, cc in gpus)


def test_refusal_reasons_name_the_rule():
    kepler = choose_branch([GpuSeen("Tesla K80", "3.7")], UBUNTU24, TABLE, 520).problems[0]
    assert kepler.startswith("Tesla K80 (3.7): the pinned stack (torch 2.6.0+cu118, CUDA 11.8) cannot run this GPU")
    assert "NVIDIA's last driver branch for Kepler GPUs is R470, older than CUDA 11.8 needs" in kepler
    h200 = choose_branch([GpuSeen("NVIDIA H200", "9.0")], DEBIAN, TABLE, 520).problems[0]
    assert "Debian 12 (bookworm) ships R535; this box needs R550 or newer" in h200 and "the NVIDIA H200 needs R550" in h200
    b200 = choose_branch([GpuSeen("NVIDIA B200", "10.0")], UBUNTU24, TABLE, 520).problems[0]
    assert "compute capability 10.0 (Blackwell): torch 2.6.0+cu118 ships GPU code for" in b200
    odd = choose_branch([GpuSeen("PCI device 10de:2335", None, "Device")], UBUNTU24, TABLE, 520).problems[0]
    assert "architecture cannot be told" in odd and "gpu_override" in odd
    none = choose_branch([], UBUNTU24, TABLE, 520).problems[0]
    assert "no GPU to choose a driver for" in none


def test_gpus_from_lspci_use_the_chip_code():
    pascal = GpuSeen("GP102GL [Tesla P40]", None, "GP102GL [Tesla P40]")
    hopper = GpuSeen("GH100[H100 SXM5 80GB]", None, "GH100[H100 SXM5 80GB]")
    assert choose_branch([pascal, hopper], FUTURE, TABLE, 520).branch.branch == 580
    h200 = GpuSeen("GH100 [H200 SXM 141GB]", None, "GH100 [H200 SXM 141GB]", "2335")
    assert choose_branch([h200], DEBIAN, TABLE, 520).branch is None           # its PCI device ID is the H200's
    # a word of the name is not the GPU: an "H200"-named device of another ID is not taken for one
    other = GpuSeen("GH100 [H200-like]", None, "GH100 [H200-like]", "2330")
    assert choose_branch([other], DEBIAN, TABLE, 520).branch.branch == 535
    assert choose_branch([GpuSeen("NVIDIA H200", "9.0")], DEBIAN, TABLE, 520).branch is None     # nvidia-smi's name
    assert choose_branch([GpuSeen("NVIDIA H200 NVL-ish", "9.0")], UBUNTU24, TABLE, 520).reason.count("R550") == 0
    unknown = GpuSeen("PCI device 10de:2335", None, "Device")
    assert "architecture cannot be told" in choose_branch([unknown], UBUNTU24, TABLE, 520).problems[0]


def test_gpus_seen_prefers_gpu_override_then_nvidia_smi_then_lspci():
    inv = GpuInventory(gpus=(Gpu(0, "Tesla T4", "7.5", 15360, 15000, "535.104.05"),))
    pci = [{"slot": "3b:00.0", "name": "GP102GL [Tesla P40]", "device": "1b38"}]
    override = {"name": "Tesla V100-SXM2-32GB", "compute_capability": "7.0", "memory_mib": 32768, "count": 2}
    v100s = ((GpuSeen("Tesla V100-SXM2-32GB", "7.0"),) * 2, "gpu_override")
    assert gpus_seen(inv, pci, override) == v100s            # set: it wins over what the box says
    assert gpus_seen(GpuInventory(problem="no smi"), pci, override) == v100s
    assert gpus_seen(inv, pci, None) == ((GpuSeen("Tesla T4", "7.5"),), "nvidia-smi")
    assert gpus_seen(GpuInventory(problem="no smi"), pci, None)[1] == "lspci"
    assert gpus_seen(None, [], None) == ((), "none")


def test_gpu_override_answers_the_refusal_that_names_it():
    """lspci lists a device pci.ids does not know: the refusal says to set gpu_override; set, it is used."""
    state = case("no_driver_nouveau_lspci")
    seen, source = gpus_seen(None, state["pci"], None)
    refused = plan_driver(want(), DriverFacts(NOBLE, state, seen, source, None))
    assert refused.action == "refuse" and "Set gpu_override" in refused.problems[0]
    override = {"name": "NVIDIA H200", "compute_capability": "9.0", "memory_mib": 143771, "count": 1}
    seen, source = gpus_seen(None, state["pci"], override)
    plan = plan_driver(want(), DriverFacts(NOBLE, state, seen, source, None))
    assert plan.action == "install" and plan.box_plan["chosen_for"] == "NVIDIA H200 (9.0) (read by gpu_override)"
    # what the install checks against the package's supported-gpus.json: the bus's device IDs, not the override
    assert plan.box_plan["gpus"] == [{"name": "GP102GL [Tesla P40]", "device": "1b38"},
                                     {"name": "Device", "device": "2335"}]
    assert plan.box_plan["supported_gpus"]["package"] == "nvidia-kernel-common-580-server"
    no_bus = plan_driver(want(), facts(case("debian12_fresh")))                 # a container: nvidia-smi's names
    assert no_bus.box_plan["gpus"] == [{"name": "Tesla P40", "device": None}]
    assert no_bus.box_plan["supported_gpus"]["package"] == "nvidia-driver"


# ---------------------------------------------------------------- apt sources and headers


UBUNTU_SOURCES = {"/etc/apt/sources.list.d/ubuntu.sources": (
    "Types: deb\nURIs: http://archive.ubuntu.com/ubuntu/\nSuites: noble noble-updates noble-backports\n"
    "Components: main universe\nSigned-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg\n\n"
    "Types: deb\nURIs: http://security.ubuntu.com/ubuntu/\nSuites: noble-security\n"
    "Components: main restricted universe multiverse\nSigned-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg\n\n"
    "Types: deb-src\nURIs: http://archive.ubuntu.com/ubuntu/\nSuites: noble\nComponents: main\n\n"
    "Enabled: no\nTypes: deb\nURIs: http://mirror.example/ubuntu/\nSuites: noble\nComponents: main\n")}


def test_sources_add_the_missing_components_for_the_boxs_own_mirrors():
    deb = parse_sources({"/etc/apt/sources.list": "# a comment\ndeb http://deb.debian.org/debian bookworm main\n"
                                                  "deb [signed-by=/k.gpg] http://security.debian.org/debian-security "
                                                  "bookworm-security main non-free-firmware\ndeb-src http://x bookworm main\n"})
    text = sources_to_add(deb, DEBIAN.components)
    assert ("Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm\n"
            "Components: contrib non-free non-free-firmware\n") in text
    assert ("URIs: http://security.debian.org/debian-security\nSuites: bookworm-security\n"
            "Components: contrib non-free\nSigned-By: /k.gpg\n") in text
    ub = parse_sources(UBUNTU_SOURCES)
    assert len(ub) == 2                                   # deb-src and the disabled stanza are not sources
    text = sources_to_add(ub, UBUNTU24.components)
    assert ("URIs: http://archive.ubuntu.com/ubuntu/\nSuites: noble noble-updates noble-backports\n"
            "Components: restricted\nSigned-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg\n") in text
    assert "security.ubuntu.com" not in text and "mirror.example" not in text
    full = parse_sources({"/etc/apt/sources.list": "deb http://m/debian bookworm main contrib non-free non-free-firmware\n"})
    assert sources_to_add(full, DEBIAN.components) == ""


def test_headers_for_the_running_kernel_and_debians_flavour():
    assert headers_packages(DEBIAN, "6.1.0-26-amd64") == ("linux-headers-6.1.0-26-amd64", "linux-headers-amd64")
    assert headers_packages(DEBIAN, "6.1.0-26-cloud-amd64")[1] == "linux-headers-cloud-amd64"
    assert headers_packages(DEBIAN, "6.18.44-fc-v1272") == ("linux-headers-6.18.44-fc-v1272",)
    assert headers_packages(UBUNTU24, "6.8.0-45-generic") == ("linux-headers-6.8.0-45-generic",)


# ---------------------------------------------------------------- the plan on recorded box states


def case(name: str) -> dict:
    return json.loads((CASES / f"{name}.json").read_text())["fact"]


def want(**data):
    return driver_want(load_settings("box1", {"driver": "install", **data}))


def facts(state, os_release=BOOKWORM, gpus=(("Tesla P40", "6.1"),), marker=None, source="nvidia-smi"):
    return DriverFacts(os_release, state, tuple(GpuSeen(n, cc) for n, cc in gpus), source, marker)


def test_a_fresh_debian_box_gets_an_install_with_its_headers_and_components():
    plan = plan_driver(want(), facts(case("debian12_fresh")))
    assert plan.action == "install" and not plan.problems
    box = plan.box_plan
    assert box["packages"] == ["nvidia-driver", "nvidia-smi", "libcuda1"]
    assert box["headers"] == ["linux-headers-6.18.44-fc-v1272"] and box["branch"] == 535
    assert box["chosen_for"] == "Tesla P40 (6.1) (read by nvidia-smi)" and "Pascal, supported up to R580" in box["reason"]
    assert "Components: contrib non-free non-free-firmware" in plan.sources


def test_an_installed_held_box_settles_and_says_why():
    plan = plan_driver(want(), facts(case("debian12_held_no_module")))
    assert plan.action == "settle", plan
    assert "no nvidia kernel module 535.261.03 exists for the running kernel 6.18.44-fc-v1272" in plan.reason


def loaded(state, version="535.261.03"):
    state = copy.deepcopy(state)
    state["loaded"] = version
    state["built"] = {"module": "nvidia-current", "version": version}
    return state


def test_done_only_when_loaded_held_pinned_and_marked():
    state = loaded(case("debian12_held_no_module"))
    marker = {"stage": "driver", "branch": "535", "version": "535.261.03"}
    assert plan_driver(want(), facts(state, marker=marker)).action == "done"
    assert plan_driver(want(), facts(state)).action == "settle"                       # no marker yet: prove
    assert plan_driver(want(), facts(state, marker={**marker, "version": "535.104.05"})).action == "settle"
    drift = copy.deepcopy(state)
    drift["packages"][0]["held"] = False                                              # someone unheld one
    assert plan_driver(want(), facts(drift, marker=marker)).action == "hold"
    nopin = copy.deepcopy(state)
    nopin["pin"] = None
    assert plan_driver(want(), facts(nopin, marker=marker)).action == "hold"
    noheaders = copy.deepcopy(state)
    noheaders["headers_installed"] = False                                            # booted a new kernel
    headers = plan_driver(want(), facts(noheaders, marker=marker))
    assert headers.action == "headers" and "the driver and its hold stay as they are" in headers.reason


def test_a_multiarch_box_is_held_until_each_architecture_is():
    """libcuda1 for amd64 and i386 (the lab's Debian 12 rootfs with ``dpkg --add-architecture i386``: dpkg's own
    output, tests/unit/test_driver_multiarch.py): two packages, the foreign one named as apt names it. Held by the
    stage before the fix (``apt-mark hold libcuda1`` holds the native one alone), the plan holds again; held by
    each architecture's name, it settles. Mutation: ``package_name`` dropping every architecture (the names of
    ``${Package}``): both cases plan "hold", on every deploy."""
    def parsed(name):                           # the recorded output parsed now, not its recorded answer
        return parse_fact_output("\n".join(json.loads((CASES / f"{name}.json").read_text())["output"]))

    old = parsed("debian12_multiarch_old_hold")
    cuda = {p["name"]: p["held"] for p in old["packages"] if p["name"].startswith("libcuda1")}
    assert cuda == {"libcuda1": True, "libcuda1:i386": False}
    assert plan_driver(want(), facts(old)).action == "hold"
    held = parsed("debian12_multiarch_held")
    assert {p["name"]: p["held"] for p in held["packages"] if p["name"].startswith("libcuda1")} == {
        "libcuda1": True, "libcuda1:i386": True}
    assert "libcuda1:i386" in held["pin"]["packages"]
    assert plan_driver(want(), facts(held)).action == "settle"


@pytest.mark.parametrize("binary,native,name", [
    ("libcuda1:amd64", "amd64", "libcuda1"),            # Multi-Arch: same, dpkg's own architecture
    ("libcuda1:i386", "amd64", "libcuda1:i386"),        # another architecture: a package of its own
    ("nvidia-driver", "amd64", "nvidia-driver"),
    ("libcuda1:arm64", "arm64", "libcuda1"),
    ("libcuda1", None, "libcuda1"),                     # recorded with ${Package}: no architecture line
])
def test_package_names_are_apts(binary, native, name):
    assert package_name(binary, native) == name


def with_units(state, **states):
    """``state`` with units in the given (active, sub) states: train=("activating", "auto-restart")."""
    names = {"train": TRAIN_UNIT, "ray": RAY_UNIT, "job": JOB_UNIT}
    units = dict(state.get("units") or {})
    for key, (active, sub) in states.items():
        units[names[key]] = {"load": "loaded", "active": active, "sub": sub, "file": "static"}
    return dict(state, units=units)


@pytest.mark.parametrize("unit,active,sub", [
    ("train", "activating", "auto-restart"),     # Restart=on-failure, RestartSec=30: it runs again within 30 s
    ("train", "active", "running"),
    ("train", "deactivating", "stop-sigterm"),
    ("train", "reloading", "running"),
    ("ray", "active", "running"),                # a cluster member's Ray node runs the workers
])
def test_no_driver_change_while_a_unit_is_in_any_state_but_inactive_or_failed(unit, active, sub):
    """Before: only exactly "active" of the training unit counted; a unit waiting to restart after a
    crash passed, and the Ray unit was named by no check."""
    name = {"train": TRAIN_UNIT, "ray": RAY_UNIT}[unit]
    plan = plan_driver(want(), facts(with_units(case("debian12_fresh"), **{unit: (active, sub)})))
    assert plan.action == "refuse" and not plan.box_plan
    assert f"{name} is {active} ({sub}): the driver stage changes no driver package under a running job" \
        in plan.problems[0]
    assert "set train_unit_state = 'stopped'" in plan.problems[0] and "driver_busy = 'stop'" in plan.problems[0]


def test_inactive_and_failed_units_are_idle():
    for active, sub in (("inactive", "dead"), ("failed", "failed")):
        state = with_units(case("debian12_fresh"), train=(active, sub), ray=(active, sub))
        assert plan_driver(want(), facts(state)).action == "install"


def test_gpu_processes_and_the_stop_policy():
    busy = dict(case("debian12_fresh"), busy=[["4242", "python3"]])
    assert "processes hold /dev/nvidia* (4242 (python3))" in plan_driver(want(), facts(busy)).problems[0]
    daemon = dict(case("debian12_fresh"), busy=[["811", "nvidia-persiste"]])     # the persistence daemon: no job
    assert plan_driver(want(), facts(daemon)).action == "install"
    # driver_busy = 'stop': the units and their own GPU processes are the box program's to stop
    training = with_units(dict(case("debian12_fresh"), busy=[["4242", "python3", f"/system.slice/{TRAIN_UNIT}"]]),
                          train=("active", "running"), ray=("activating", "auto-restart"))
    assert plan_driver(want(), facts(training)).action == "refuse"
    stop = plan_driver(want(driver_busy="stop"), facts(training))
    assert stop.action == "install" and stop.box_plan["busy"] == "stop"
    assert stop.box_plan["units"] == [TRAIN_UNIT, RAY_UNIT, "verl-lab-burnin.service"]
    # a GPU process in no unit the stage may stop is refused under either policy
    other = dict(training, busy=[["977", "jupyter", "/user.slice/user-1000.slice/session-4.scope"]])
    refused = plan_driver(want(driver_busy="stop"), facts(other))
    assert refused.action == "refuse" and "977 (jupyter, in session-4.scope)" in refused.problems[0]
    assert f"{TRAIN_UNIT} is" not in refused.problems[0]


def test_headers_alone_are_no_driver_change():
    held = with_units(loaded(case("debian12_held_no_module")), train=("active", "running"))
    assert plan_driver(want(), facts(dict(held, headers_installed=False))).action == "headers"
    assert plan_driver(want(), facts(dict(held, headers_installed=True))).action == "settle"


def test_a_change_dpkg_left_unconfigured_is_finished_not_held():
    """A job killed mid-dpkg, `dpkg --configure -a` run by hand: the configured packages at one
    version, held and pinned, four left unconfigured. Before, the plan judged the configured ones
    alone and said "hold": the four stayed out of the pin and unconfigured."""
    state = copy.deepcopy(loaded(case("debian12_held_no_module")))
    left = {"libegl-nvidia0", "libgl1-nvidia-glvnd-glx", "libglx-nvidia0", "nvidia-egl-icd"}   # as a kill left them
    for p in state["packages"]:
        if p["name"] in left:
            p.update(status="iU", installed=False)
    marker = {"stage": "driver", "branch": "535", "version": "535.261.03"}
    plan = plan_driver(want(), facts(state, marker=marker))
    assert plan.action == "install" and plan.reason.startswith("dpkg left ") and "(iU)" in plan.reason
    assert "not configured (a driver change that stopped part-way): finishing it" in plan.reason
    busy = plan_driver(want(), facts(with_units(state, train=("active", "running")), marker=marker))
    assert busy.action == "refuse"


def test_a_running_job_is_followed_and_leftover_masks_are_removed():
    """A run that lost its connection left apt running in the job unit: a re-run follows it instead of
    judging a box under a running apt (the packages half-installed look like a fresh install), and
    removes masks only where no job runs."""
    state = with_units(loaded(case("debian12_held_no_module")), job=("active", "running"))
    state = dict(state, masks=[TRAIN_UNIT])
    marker = {"stage": "driver", "branch": "535", "version": "535.261.03"}
    plan = plan_driver(want(), facts(state, marker=marker))
    assert plan.action == "follow" and "still running on the box (verl-lab-driver-apt.service)" in plan.reason
    assert plan.unmask == ()
    left = dict(state, units={})
    assert plan_driver(want(), facts(left, marker=marker)).unmask == (TRAIN_UNIT,)
    assert plan_driver(want(), facts(left, marker=marker)).action == "done"


def test_refusals_on_recorded_states():
    sb = plan_driver(want(), facts(case("secure_boot_on")))
    assert sb.action == "refuse" and "Secure Boot is on (SecureBoot enabled)" in sb.problems[0]
    run = plan_driver(want(), facts(case("runfile_driver")))
    assert run.action == "refuse"
    assert ("/usr/bin/nvidia-uninstall exists; /var/log/nvidia-installer.log says installer version 550.107.02; "
            "/usr/lib/x86_64-linux-gnu/libcuda.so.550.107.02 belongs to no package") in run.problems[0]
    rocky = plan_driver(want(), facts(case("debian12_fresh"), os_release={"ID": "rocky", "VERSION_ID": "9.4",
                                                                         "PRETTY_NAME": "Rocky Linux 9.4"}))
    assert rocky.action == "refuse" and "does not know 'Rocky Linux 9.4'" in rocky.problems[0]
    k80 = plan_driver(want(), facts(case("debian12_fresh"), gpus=(("Tesla K80", "3.7"),)))
    assert k80.action == "refuse" and "Kepler" in k80.problems[0]


def test_packages_of_another_branch_held_by_someone_else_are_not_fought():
    state = copy.deepcopy(case("debian12_fresh"))
    state["packages"] = [{"name": "nvidia-tesla-470-driver", "source": "nvidia-graphics-drivers-tesla-470",
                          "version": "470.256.02-1~deb12u1", "installed": True, "held": True}]
    plan = plan_driver(want(), facts(state))
    assert plan.action == "refuse" and "nvidia-tesla-470-driver" in plan.problems[0] and "apt-mark unhold" in plan.problems[0]


def test_no_main_source_is_refused():
    state = copy.deepcopy(case("debian12_fresh"))
    state["sources"] = {}
    assert "no enabled apt source" in plan_driver(want(), facts(state)).problems[0]


def test_a_box_without_a_driver_is_read_from_lspci():
    state = case("no_driver_nouveau_lspci")
    seen, source = gpus_seen(GpuInventory(problem="nvidia-smi is not installed"), state["pci"], None)
    assert source == "lspci" and [g.pci_name for g in seen] == ["GP102GL [Tesla P40]", "Device"]
    plan = plan_driver(want(), DriverFacts(NOBLE, state, seen, source, None))
    assert plan.action == "refuse" and "10de:2335" in plan.problems[0]     # pci.ids 2023 does not know the H200
    p40_only = dict(state, pci=state["pci"][:1])
    seen, source = gpus_seen(None, p40_only["pci"], None)
    plan = plan_driver(want(), DriverFacts(NOBLE, p40_only, seen, source, None))
    assert plan.action == "install" and plan.box_plan["branch"] == 580
    assert plan.box_plan["chosen_for"] == "GP102GL [Tesla P40] (PCI 10de:1b38) (read by lspci)"


# ---------------------------------------------------------------- the box-side verdict


@pytest.mark.parametrize("loaded_v,nouveau,built,want_verdict", [
    ("535.261.03", False, "535.261.03", "loaded"),
    (None, False, "535.261.03", "load"),
    (None, True, "535.261.03", "reboot"),
    ("470.256.02", False, "535.261.03", "reboot"),
    ("470.256.02", False, None, "no-module"),
    (None, False, "470.256.02", "no-module"),
])
def test_verdicts(loaded_v, nouveau, built, want_verdict):
    state = dict(case("debian12_held_no_module"), loaded=loaded_v, nouveau=nouveau,
                 built={"module": "nvidia-current", "version": built} if built else None)
    v = verdict(state, "nvidia-kernel-dkms")
    assert v["verdict"] == want_verdict and v["installed"] == "535.261.03"
    if want_verdict == "reboot":
        assert ("nouveau" if nouveau else "470.256.02") in v["reason"]
    assert verdict(case("debian12_fresh"), "nvidia-kernel-dkms")["verdict"] == "missing"


# ---------------------------------------------------------------- the CUDA stage trusts the driver stage


def test_cuda_stage_leaves_the_driver_to_the_driver_stage():
    settings = load_settings("box1", {"driver": "install"})
    w = cuda_want(settings)
    roomy = {"filesystem": "/dev/vda", "mount": "/", "free_mib": 80000}
    base = CudaFacts(os_release=BOOKWORM, driver=None, toolkits={"link": None, "toolkits": {}},
                     disk={w.tmpdir: roomy, w.prefix: roomy, w.box_cache: roomy},
                     compiler=decide_compiler(BOOKWORM, {"gcc": "12.2.0", "gcc-11": "/usr/bin/gcc-11",
                                                         "g++-11": "/usr/bin/g++-11"}), marker=None)
    assert "no NVIDIA driver found" in plan_cuda(w, base).problems[0]
    managed = dataclasses.replace(base, driver_stage="R535, installed and proven by the driver stage")
    assert plan_cuda(w, managed).action == "install"


def test_settings():
    s = load_settings("b", {"driver": "install", "driver_reboot": True})
    assert (s.driver, s.driver_reboot) == ("install", True)
    assert load_settings("b", {}).driver == "check"
    for data, words in (({"driver": "yes"}, "driver: 'yes' is not one of check, install"),
                        ({"driver_reboot": True}, "driver_reboot: True does nothing with driver = 'check'"),
                        ({"driver": "install", "driver_reboot": "yes"}, "driver_reboot: 'yes' is not True/False")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            load_settings("b", data)


def test_check_mode_asks_the_box_nothing_of_its_own_in_full_py(monkeypatch):
    """driver = "check": in deploy/full.py the stage's facts (what an earlier driver = "install" left) come with the
    undo stage's one bundle (tasks/undo.py ``driver_found``), so the re-run's commands per host do not grow
    (bench/noop_rerun.py); a box the stage never managed gets the host's target untouched and no operation. Alone
    (deploy/driver.py) it asks one bundle."""
    from tasks.driver import stage
    from tasks.facts.driver import DriverLeft
    from tasks.target import HostTarget

    asked = []

    def no_fact(*a, **k):
        raise AssertionError("the driver stage asked the box in check mode")

    monkeypatch.setattr(stage, "ask", no_fact)
    monkeypatch.setattr(stage.server, "shell", no_fact)
    target = HostTarget(GpuInventory(), None, "none")
    found = (DriverLeft.default(), {})
    assert stage.install_driver.__wrapped__(load_settings("box1", {}), target, found) is target
    monkeypatch.setattr(stage, "ask", lambda *facts: asked.append(facts) or [DriverLeft.default(), {}])
    assert stage.install_driver.__wrapped__(load_settings("box1", {}), target) is target
    assert [[cls.__name__ for cls, _ in facts] for facts in asked] == [["DriverLeft", "PathStates"]]
