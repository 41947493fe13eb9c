"""The driver stage's guards that keep a working box working (issue 36), on plain values: the
installed module's branch, NVSwitch boxes and Fabric Manager, a newer build of the held branch
taken on purpose and the status notes, and the smaller checks (Ubuntu's R580 alone, the distro's
own archive, Secure Boot unknown, lockdown, backports kernels' headers, the initramfs, the sysfs
PCI fallback). The plan's helpers are tests/unit/test_driver.py's."""

from __future__ import annotations

import copy
import datetime
from pathlib import Path

import pytest

from tasks.driver import headers_packages, parse_sources, plan_driver, sources_to_add
from tests.unit.test_driver import (
    DEBIAN,
    NOBLE,
    UBUNTU22,
    UBUNTU24,
    UBUNTU_SOURCES,
    case,
    facts,
    loaded,
    want,
    with_units,
)

# ---------------------------------------------------------------- the installed module's branch


def with_packages(state, version, source="nvidia-graphics-drivers", held=False):
    state = copy.deepcopy(state)
    for p in state["packages"]:
        if p["source"] == "nvidia-graphics-drivers":
            p.update(version=version, source=source, held=held)
    state["pin"] = None
    return state


def test_a_590_driver_on_a_pascal_box_is_refused_not_held():
    """NVIDIA's CUDA repository ships 590 under Debian's own package and source names: before, the
    plan said "hold" and the marker R535 while the box ran a branch that no longer runs Pascal."""
    state = with_packages(case("debian12_held_no_module"), "590.44.01-1")
    state["archive"] = {"nvidia-kernel-dkms": [
        {"version": "590.44.01-1", "from": "https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64  Packages"},
        {"version": "535.261.03-1", "from": "http://deb.debian.org/debian bookworm/non-free amd64 Packages"}]}
    plan = plan_driver(want(), facts(state))
    assert plan.action == "refuse", plan
    text = plan.problems[0]
    assert "the installed NVIDIA kernel module is nvidia-kernel-dkms 590.44.01-1 (R590, from https://developer." in text
    assert "R535 was chosen" in text and "R590 is outside what the GPUs here run (R520 .. R580)" in text
    assert "apt-get purge" in text
    # installed by hand: said so; a T4 box (no upper end) is refused too: R590 is not the chosen branch
    state["archive"] = {}
    text = plan_driver(want(), facts(state, gpus=(("Tesla T4", "7.5"),))).problems[0]
    assert "from no archive this box lists" in text and "outside" not in text
    # the stage's own pinned install of another branch may be replaced (Ubuntu: 535-server -> 580-server)
    ours = with_packages(case("debian12_held_no_module"), "470.256.02-1")
    ours["pin"] = {"packages": ["nvidia-kernel-dkms"], "version": "470.256.02-1"}
    assert plan_driver(want(), facts(ours)).action == "install"


# ---------------------------------------------------------------- NVSwitch boxes (HGX)


LSPCI_HGX = (Path(__file__).resolve().parents[1] / "fixtures" / "driver" / "lspci-hgx-h100.txt").read_text()


def hgx_state():
    from verl_lab_box.nvidia_driver_state import SECTION, parse_fact_output

    state = parse_fact_output(f"{SECTION}pci\n{LSPCI_HGX}")
    assert len(state["pci"]) == 8 and len(state["nvswitches"]) == 4
    assert state["nvswitches"][0] == {"slot": "05:00.0", "name": "GH100 [H100 NVSwitch]", "device": "22a3"}
    fresh = copy.deepcopy(case("debian12_fresh"))
    fresh.update(pci=state["pci"], nvswitches=state["nvswitches"], kernel="6.8.0-45-generic")
    fresh["sources"] = UBUNTU_SOURCES
    return fresh


def test_an_nvswitch_box_gets_fabric_manager_on_ubuntu_and_is_refused_on_debian():
    h100s = (("NVIDIA H100 80GB HBM3", "9.0"),) * 8
    debian = plan_driver(want(), facts(hgx_state(), gpus=h100s))
    assert debian.action == "refuse"
    assert "4 NVSwitch(es) on the PCI bus (10de:22a3)" in debian.problems[0]
    assert "error 802" in debian.problems[0] and "Debian 12 (bookworm) ships none" in debian.problems[0]
    ubuntu = plan_driver(want(), facts(hgx_state(), os_release=NOBLE, gpus=h100s))
    assert ubuntu.action == "install"
    assert ubuntu.box_plan["fabricmanager"] == {"package": "nvidia-fabricmanager-580",
                                                "service": "nvidia-fabricmanager.service"}
    # installed and held without Fabric Manager: installed again (with it)
    state = hgx_state()
    state["packages"] = [{"name": n, "source": "nvidia-graphics-drivers-580-server", "version": "580.196.07-0ubuntu0.24.04.1",
                          "installed": True, "held": True}
                         for n in ("nvidia-headless-580-server", "nvidia-utils-580-server", "nvidia-dkms-580-server")]
    state["headers_installed"] = True
    state["pin"] = {"packages": [p["name"] for p in state["packages"]], "version": "580.196.07-0ubuntu0.24.04.1"}
    assert plan_driver(want(), facts(state, os_release=NOBLE, gpus=h100s)).action == "install"
    fm = {"name": "nvidia-fabricmanager-580", "source": "fabric-manager-580", "version": "580.196.07-0ubuntu0.24.04.1",
          "installed": True, "held": False}
    state["packages"].append(fm)
    assert plan_driver(want(), facts(state, os_release=NOBLE, gpus=h100s)).action == "hold"      # FM not held
    fm["held"] = True
    state["pin"]["packages"].append(fm["name"])
    assert plan_driver(want(), facts(state, os_release=NOBLE, gpus=h100s)).action == "settle"
    fm["version"] = "580.95.05-0ubuntu0.24.04.2"                                                   # not the driver's
    assert plan_driver(want(), facts(state, os_release=NOBLE, gpus=h100s)).action == "install"
    # no NVSwitch: no Fabric Manager
    plain = dict(hgx_state(), nvswitches=[])
    assert plan_driver(want(), facts(plain, os_release=NOBLE, gpus=h100s)).box_plan["fabricmanager"] is None


# ---------------------------------------------------------------- the branch's newer builds, on purpose


SECURITY = [{"version": "535.309.01-0+deb12u1", "from": "http://security.debian.org/debian-security bookworm-security/non-free amd64 Packages"},
            {"version": "535.261.03-1", "from": "http://deb.debian.org/debian bookworm/non-free amd64 Packages"}]


def proven_with_newer_build():
    state = loaded(case("debian12_held_no_module"))
    state["archive"] = {"nvidia-kernel-dkms": SECURITY}
    return state, {"stage": "driver", "branch": "535", "version": "535.261.03"}


def test_a_newer_build_is_taken_only_on_purpose_and_only_on_an_idle_box():
    state, marker = proven_with_newer_build()
    assert plan_driver(want(), facts(state, marker=marker)).action == "done"          # the pin keeps it out
    plan = plan_driver(want(driver_update=True), facts(state, marker=marker))
    assert plan.action == "update" and plan.box_plan["update"] is True
    assert "535.261.03-1 -> 535.309.01-0+deb12u1" in plan.reason
    for unit in ("train", "ray"):
        busy = plan_driver(want(driver_update=True),
                           facts(with_units(state, **{unit: ("activating", "auto-restart")}), marker=marker))
        assert busy.action == "refuse" and "is activating (auto-restart): the driver stage" in busy.problems[0]
    # taken: the newest is installed; nothing newer, nothing to do
    taken = copy.deepcopy(state)
    for p in taken["packages"]:
        p["version"] = "535.309.01-0+deb12u1"
    taken["pin"]["version"] = "535.309.01-0+deb12u1"
    taken = loaded(taken, "535.309.01")
    assert plan_driver(want(driver_update=True), facts(taken, marker=dict(marker, version="535.309.01"))).action == "done"


def test_status_says_newer_build_and_end_of_life():
    import datetime

    from tasks.driver import driver_notes
    from tasks.status import box_status, render_rows

    state, _ = proven_with_newer_build()
    before = driver_notes(state, DEBIAN, datetime.date(2026, 6, 30))
    assert len(before) == 1 and "a newer build of the held R535 is in this box's archive: 535.309.01" in before[0]
    assert "set driver_update = True" in before[0]
    after = driver_notes(state, DEBIAN, datetime.date(2026, 7, 1))
    assert "R535 is past its end of life (June 2026, NVIDIA)" in after[1]
    state["archive"] = {"nvidia-kernel-dkms": SECURITY[1:]}
    assert driver_notes(state, DEBIAN, datetime.date(2026, 5, 1)) == []                 # newest held, supported
    assert driver_notes(dict(state, pin=None), DEBIAN, datetime.date(2027, 1, 1)) == []  # nothing held by the stage
    row = dict(box_status("box1", {}, {}, "", None), driver_notes=after)
    assert after[1] in render_rows([row])


def test_status_says_a_driver_change_runs_or_left_the_units_masked():
    from tasks.driver import driver_notes

    state, _ = proven_with_newer_build()
    state["archive"] = {}
    left = dict(state, masks=["verl-lab-train.service"])
    notes = driver_notes(left, DEBIAN, datetime.date(2026, 5, 1))
    assert notes == ["driver: verl-lab-train.service masked by a driver change that did not end "
                     "(/run/systemd/system.control), and no driver change runs: the unit cannot start. Re-run the "
                     "driver stage (it removes the masks it left), or `rm /run/systemd/system.control/"
                     "verl-lab-train.service && systemctl daemon-reload`"]
    running = with_units(left, job=("active", "running"))
    assert driver_notes(running, DEBIAN, datetime.date(2026, 5, 1)) == [
        "driver: a driver change is running (verl-lab-driver-apt.service, active): verl-lab-train.service masked until "
        "it ends; `journalctl -fu verl-lab-driver-apt.service` follows it"]
    assert driver_notes(dict(running, pin=None), DEBIAN)[0].startswith("driver: a driver change is running")


# ---------------------------------------------------------------- the smaller items (issue 36)


def test_ubuntu_offers_r580_alone():
    """Ubuntu's 535-server packages are now wrappers that depend on 580-server: R535 is not offered."""
    assert [b.branch for b in UBUNTU22.branches] == [580] and [b.branch for b in UBUNTU24.branches] == [580]
    assert [b.branch for b in DEBIAN.branches] == [535] and DEBIAN.branches[0].end_of_life == "2026-06"


def test_components_are_added_to_the_distros_own_archive_only():
    vendor = parse_sources({"/etc/apt/sources.list.d/vendor.list": "deb http://repo.vendor.example/debian bookworm main\n",
                            "/etc/apt/sources.list": "deb http://mirror.example.org/debian bookworm main\n"
                                                     "deb http://deb.debian.org/debian bookworm-updates main\n"})
    origins = {"repo.vendor.example_debian_dists_bookworm": "Vendor Inc.",
               "mirror.example.org_debian_dists_bookworm": "Debian"}
    text = sources_to_add(vendor, DEBIAN.components, origins, DEBIAN.origin)
    assert "repo.vendor.example" not in text                         # its Release says another Origin
    assert "URIs: http://mirror.example.org/debian\nSuites: bookworm\n" in text     # a Debian mirror: Origin Debian
    assert "URIs: http://deb.debian.org/debian\nSuites: bookworm-updates\n" in text  # lists not fetched: Debian's host
    assert "repo.vendor.example" not in sources_to_add(vendor, DEBIAN.components, {}, DEBIAN.origin)
    from tasks.driver import list_name
    assert list_name("http://deb.debian.org/debian/", "bookworm-security") == "deb.debian.org_debian_dists_bookworm-security"
    # the recorded lab box: its lists' Origin (none recorded: Debian's host)
    plan = plan_driver(want(), facts(case("debian12_fresh")))
    assert "Components: contrib non-free non-free-firmware" in plan.sources


def test_secure_boot_unknown_is_refused_and_shim_validation_off_is_not_on():
    from verl_lab_box.nvidia_driver_state import secure_boot_state

    shim_off = secure_boot_state(["SecureBoot enabled", "SecureBoot validation is disabled in shim"])
    assert shim_off["state"] == "disabled"                       # mokutil 0.6.0's words: unsigned modules load
    assert plan_driver(want(), facts(dict(case("debian12_fresh"), secure_boot=shim_off))).action == "install"
    unknown = secure_boot_state(["efi"])                         # EFI, no mokutil, the variable unreadable
    assert unknown["state"] == "unknown"
    plan = plan_driver(want(), facts(dict(case("debian12_fresh"), secure_boot=unknown)))
    assert plan.action == "refuse" and "whether Secure Boot is on cannot be told" in plan.problems[0]
    assert "apt-get install mokutil" in plan.problems[0]


def test_kernel_lockdown_without_secure_boot_is_refused():
    from verl_lab_box.nvidia_driver_state import lockdown_mode

    assert lockdown_mode(["none [integrity] confidentiality"]) == "integrity"
    assert lockdown_mode(["[none] integrity confidentiality"]) == "none" and lockdown_mode([]) is None
    plan = plan_driver(want(), facts(dict(case("debian12_fresh"), lockdown="integrity")))
    assert plan.action == "refuse" and "the kernel is locked down (integrity" in plan.problems[0]
    assert plan_driver(want(), facts(dict(case("debian12_fresh"), lockdown="none"))).action == "install"


def test_backports_and_trixie_style_kernels_get_their_headers_metapackage():
    assert headers_packages(DEBIAN, "6.12.12+bpo-amd64") == ("linux-headers-6.12.12+bpo-amd64",
                                                              "linux-headers-amd64/bookworm-backports")
    assert headers_packages(DEBIAN, "6.12.12+bpo-cloud-amd64")[1] == "linux-headers-cloud-amd64/bookworm-backports"
    assert headers_packages(DEBIAN, "6.12.12-amd64")[1] == "linux-headers-amd64"


def test_a_replaced_nouveau_blacklist_rebuilds_the_initramfs():
    from tasks.driver import BLACKLIST_FILE, initramfs_rebuild

    assert initramfs_rebuild({BLACKLIST_FILE: "missing"}, "done")         # placed again on a proven box
    assert initramfs_rebuild({BLACKLIST_FILE: "other content"}, "settle")
    assert not initramfs_rebuild({BLACKLIST_FILE: "missing"}, "install")  # the install rebuilds it itself
    assert not initramfs_rebuild({BLACKLIST_FILE: None}, "done")


def test_the_sysfs_fallback_reads_nvidia_devices_without_lspci(tmp_path, monkeypatch):
    """No lspci on the box: the fact command reads /sys/bus/pci/devices (here a folder laid out as
    sysfs is) with a shell whose PATH has no lspci."""
    import os
    import shutil
    import subprocess

    from verl_lab_box import nvidia_driver_state as st

    for slot, vendor, cls, device in (("0000:3b:00.0", "0x10de", "0x030200", "0x1b38"),
                                      ("0000:3b:00.1", "0x10de", "0x040300", "0x10f0"),   # its audio function
                                      ("0000:05:00.0", "0x10de", "0x068000", "0x22a3"),   # an NVSwitch
                                      ("0000:00:02.0", "0x8086", "0x030000", "0x3e92")):  # another vendor's VGA
        d = tmp_path / "devices" / slot
        d.mkdir(parents=True)
        for name, value in (("vendor", vendor), ("class", cls), ("device", device)):
            (d / name).write_text(value + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cat",):
        os.symlink(shutil.which(tool), bin_dir / tool)
    monkeypatch.setattr(st, "PCI_DEVICES", str(tmp_path / "devices"))
    out = subprocess.run(["/bin/sh", "-c", st.fact_command("/nonexistent", "x.service")], capture_output=True,
                         text=True, env={"PATH": str(bin_dir)})
    state = st.parse_fact_output(out.stdout)
    assert state["pci"] == [{"slot": "0000:3b:00.0", "name": None, "device": "1b38"}]
    assert state["nvswitches"] == [{"slot": "0000:05:00.0", "name": None, "device": "22a3"}]


def test_the_driver_busy_setting():
    from tasks.settings import SettingsErrors, load_settings

    assert load_settings("box1", {"driver": "install"}).driver_busy == "refuse"
    assert load_settings("box1", {"driver": "install", "driver_busy": "stop"}).driver_busy == "stop"
    for data, said in (({"driver": "install", "driver_busy": "kill"}, "'kill' is not one of refuse, stop"),
                       ({"driver_busy": "stop"}, "'stop' does nothing with driver = 'check'")):
        with pytest.raises(SettingsErrors) as err:
            load_settings("box1", data)
        assert said in str(err.value) and "driver_busy" in str(err.value)


def test_the_doctors_mask_fact_reads_the_stages_own_links():
    from tasks.facts.driver import DriverMasks

    cmd = DriverMasks().command(["verl-lab-train.service", "verl-lab-ray.service"])
    assert "readlink /run/systemd/system.control/verl-lab-train.service" in cmd
    assert "readlink /run/systemd/system.control/verl-lab-ray.service" in cmd
    assert "systemctl is-active verl-lab-driver-apt.service" in cmd and "grep -m1 'Loaded:'" in cmd
    assert DriverMasks().process(["", " "]) == {}
    seen = (Path(__file__).parents[1] / "fixtures" / "doctor" / "driver-units-masked.log").read_text().splitlines()
    assert DriverMasks().process(seen) == {"driver masks": "\n".join(seen)}     # the recorded output, as the doctor reads it
