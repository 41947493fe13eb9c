"""verl's trackers on two lab boxes, and the lab's TensorBoard seen in a real browser.

- ``box1`` (the hub, ``artifact_mode = "direct"``: it has internet, so wandb logs online): the training
  stage gives it the wandb key in ``tracking-keys.env`` (0400, the train user's); TensorBoard from a venv
  at the env's prefix (the real tensorboard 2.20.0 wheel and its dependencies from the env's wheelhouse)
  serves the lab's curves from ``verl-lab-tensorboard.service``;
- ``box2`` (relay: no internet): wandb logs offline, the box gets no key; the controller copies its offline
  run and syncs it with ``wandb sync`` (the real wandb 0.21.0 command) to a stand-in server speaking wandb's
  API (tests/fixtures/standins/wandb_server.py), with the key in the sync's environment.

What verl writes, placed where the boxes' train.env points verl (TENSORBOARD_DIR, WANDB_DIR; no box trains
here): on box1 a real GPU run's TensorBoard event files (verl 0.5.0 on the H200, GPU call 14:
tests/fixtures/tracking/gpu-run); on box2 event files and a wandb offline run made on CPU by verl 0.5.0's own
``Tracking`` class, replaying a real GPU run's logged steps (tests/fixtures/tracking). The GSM8K scores of box2 are
JSON files as the launcher writes them (tests/e2e/test_export.py makes real ones). Proven: the train stage's
tracker folders, environment and keys file on real boxes; deploy/tracking.py's copy through the controller
onto the hub; the unit, bound to 127.0.0.1, at the address deploy/status.py prints for the lab and through the
SSH tunnel it prints for a hub elsewhere; Debian's
chromium (driven by selenium) showing verl's metric names and their curves (coloured pixels in each chart's
canvas); the sync reaching the server with the run's history and the key; no key in argv-visible places, logs
or world-readable files on the boxes; curves kept after a box goes away.

Then the edges (docs/tracking.md, "What root touches"): box2's event file grows after the first copy (the bytes
appended as verl appends them) and the browser shows the new steps, the hub's file appended in place and the
unit not restarted; a replaced file is served after the push restarts the unit; while box2's train user plants
links (to a root-only file, a world-readable one, a folder), a root-owned file and a file it locked in its
tracker folder and swaps a file for a link as fast as it can, nothing of them reaches the controller or the hub;
the hub's served copy is one its train user can change nothing in; the offline run is synced once, a run the
server refused is synced later, from the cache, with box2 gone from the inventory; ``pyinfra --diff`` of a key
change prints no key.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tasks.tracking.events import _event, record, scalar_value
from tests.fixtures.standins.wandb_server import WandbServer
from tests.fixtures.tracking import VERL_TAGS, recorded_run, verl_event_files, verl_wandb_offline_run
from tests.lab import BoxSpec
from tests.lab.box import free_port
from tests.lab.env_venv import install_env

HUB, OTHER = "box1", "box2"
ROOT = "/opt/verl-lab"
RUNS = {HUB: "box1-qwen2.5-0.5b-gsm8k-ppo", OTHER: "box2-qwen2.5-0.5b-gsm8k-grpo"}
KEY = secrets.token_hex(20)           # a made-up 40-character wandb key, new each run
KEY2 = secrets.token_hex(20)          # the key it is changed to (pyinfra --diff)
SCORE_TAG = "verl_lab/gsm8k_accuracy"
TB_UNIT = "verl-lab-tensorboard.service"
SERVED = f"{ROOT}/tracking-lab"
# what box2's train user plants in its tracker folder: none of it may reach the controller or the hub
PLANTED = {name: f"{name}-{secrets.token_hex(8)}" for name in ("root-only", "world-readable", "elsewhere", "locked",
                                                                "roots")}


@pytest.fixture(scope="module")
def lab(lab_factory):
    lab = lab_factory([BoxSpec(HUB, gpu="t4"), BoxSpec(OTHER, gpu="p40")])
    install_env([lab.box(HUB)], "tensorboard==2.20.0")
    return lab


@pytest.fixture(scope="module")
def wandb_server():
    with WandbServer() as server:
        yield server


@pytest.fixture(scope="module")
def settings(lab, wandb_server, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "trackers.env"
    keys.write_text(f"WANDB_API_KEY={KEY}\n")
    keys.chmod(0o600)
    tracking = {"trackers": ["tensorboard", "wandb"], "keys_file": str(keys), "hub": HUB, "port": free_port(),
                "wandb_base_url": wandb_server.url}
    per_host = {HUB: {"artifact_mode": "direct", "tracking": {**tracking, "mode": "online"}},
                OTHER: {"tracking": tracking, "workload": {"algorithm": "grpo"}}}
    return {"per_host": per_host, "port": tracking["port"]}


ARGV_HITS: list[str] = []      # process argv lines holding the key, sampled during the deploys
MADE: dict = {}                # verl's test env and source tree, for a second offline run
SYNCED_RUNS: list[str] = []    # the run ids the server took, in order


@contextlib.contextmanager
def argv_sampled():
    """Every process's argv on this machine (the controller's, the sync's, and through nspawn the
    boxes') sampled for the key while the block runs."""
    done = threading.Event()

    def sample():
        while not done.is_set():
            out = subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True).stdout
            ARGV_HITS.extend(line for line in out.splitlines() if KEY in line or KEY2 in line)
            done.wait(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()


@pytest.fixture(scope="module")
def trained(lab, settings):
    with argv_sampled():
        res = lab.deploy("deploy/train.py", per_host=settings["per_host"], mode="text", timeout=900)
    assert res.rc == 0 and not res.failed_hosts, res.tail()
    return res


def test_train_stage_points_verl_at_the_trackers(lab, trained):
    hub, other = lab.box(HUB), lab.box(OTHER)
    env = hub.read_text(f"{ROOT}/train/train.env")
    assert f"TENSORBOARD_DIR={ROOT}/tracking/tensorboard/{RUNS[HUB]}\n" in env
    assert "WANDB_MODE=online\n" in env and KEY not in env
    plan = json.loads(other.read_text(f"{ROOT}/train/plan.json"))
    lines = [o["override"] for o in plan["launch"]["overrides"]]
    assert "trainer.logger=['console','tensorboard','wandb']" in lines
    assert f"trainer.experiment_name={RUNS[OTHER]}" in lines
    assert "WANDB_MODE=offline\n" in other.read_text(f"{ROOT}/train/train.env")
    for box in (hub, other):
        assert box.stat(f"{ROOT}/tracking/tensorboard") == ("750", "verl", "verl")
        assert f"ReadWritePaths={ROOT}/train/work" in box.read_text("/etc/systemd/system/verl-lab-train.service")


def test_online_key_is_the_train_users_alone_and_nowhere_else(lab, trained):
    hub, other = lab.box(HUB), lab.box(OTHER)
    keys = f"{ROOT}/train/tracking-keys.env"
    assert hub.stat(keys) == ("400", "verl", "verl") and hub.read_text(keys) == f"WANDB_API_KEY={KEY}\n"
    unit = hub.read_text("/etc/systemd/system/verl-lab-train.service")
    assert f"EnvironmentFile={keys}\n" in unit and KEY not in unit
    assert not other.exists(keys), "an offline box got a key"
    for box, allowed in ((hub, keys), (other, None)):
        found = box.ssh(f"grep -rlsF {shlex.quote(KEY)} /opt /etc /var/log /tmp /var/tmp /root /home || true").stdout
        assert found.split() == ([allowed] if allowed else []), found
        journal = box.ssh(f"journalctl --no-pager | grep -cF {shlex.quote(KEY)} || true").stdout.strip()
        assert journal == "0", f"{box.name}: the key is in the journal"
    assert KEY not in trained.output


def place_as_verl_wrote(box, local: Path, dest: str) -> None:
    """``local``'s files where verl (the train user) would have written them on ``box``."""
    target = box.root / dest.lstrip("/")
    shutil.copytree(local, target, dirs_exist_ok=True)
    # (and the folders above it under the tracker's folder, as the tracker makes them)
    top = f"{ROOT}/tracking/" + dest.split(f"{ROOT}/tracking/", 1)[1].split("/", 1)[0]
    box.ssh(f"chown -R verl:verl {shlex.quote(top)}")


@pytest.fixture(scope="module")
def verl_wrote(lab, trained, tmp_path_factory):
    """What verl's trackers write during a run, made by verl's own Tracking on CPU."""
    from tests.fixtures.standins.env import test_env, verl_tree

    work = tmp_path_factory.mktemp("verl-out")
    python, verl_root = test_env(), verl_tree(work / "src")
    for name in (HUB, OTHER):
        events = verl_event_files(python, verl_root, work / name / RUNS[name], experiment=RUNS[name])
        if name == HUB and recorded_run():       # the hub shows the real GPU run's files where they are committed
            shutil.rmtree(events)
            shutil.copytree(recorded_run(), events)
        place_as_verl_wrote(lab.box(name), events, f"{ROOT}/tracking/tensorboard/{RUNS[name]}")
    run = verl_wandb_offline_run(python, verl_root, work / "wandb", experiment=RUNS[OTHER])
    place_as_verl_wrote(lab.box(OTHER), run, f"{ROOT}/tracking/wandb/wandb/{run.name}")
    MADE.update(python=python, verl_root=verl_root, work=work)
    # box2's run finished: the launcher's GSM8K scores of the base model and of the proven export of step 5
    ckpt = f"{ROOT}/train/checkpoints"
    other = lab.box(OTHER)
    # (as verl_lab_box/gsm8k_score.py writes them: indented, a newline at the end)
    # the export's folder as its proof lists it (the files decide whether an export exists: tasks/facts/export.py)
    other.write_text(f"{ckpt}/global_step_5/hf/config.json", "{}\n")
    for path, data in (("gsm8k-base.json", {"accuracy": 0.25, "rows": 1319}),
                       ("global_step_5/hf.proof.json", {"ok": True, "final": True,
                                                        "files": [{"name": "config.json", "bytes": 3}]}),
                       ("global_step_5/hf.gsm8k.json", {"accuracy": 0.4, "rows": 1319, "step": 5, "final": True})):
        other.write_text(f"{ckpt}/{path}", json.dumps(data, indent=2, sort_keys=True) + "\n")
    return run


@pytest.fixture(scope="module")
def tracked(lab, settings, verl_wrote):
    with argv_sampled():
        res = lab.deploy("deploy/tracking.py", per_host=settings["per_host"], mode="text", timeout=900)
    assert res.rc == 0 and not res.failed_hosts, res.tail()
    return res


def test_hub_serves_every_boxs_event_files_from_its_unit(lab, settings, tracked):
    hub = lab.box(HUB)
    assert hub.ssh("systemctl is-active verl-lab-tensorboard.service").stdout.strip() == "active"
    files = hub.ssh(f"cd {SERVED} && find . -type f | sort").stdout.split()
    for name in (HUB, OTHER):
        assert any(f.startswith(f"./{name}/{RUNS[name]}/events.out.tfevents.") for f in files), files
    assert any(f.startswith(f"./{OTHER}/verl-lab/events.out.tfevents.") for f in files), files
    # TensorBoard runs as the train user and listens on 127.0.0.1 only
    assert hub.ssh("systemctl show -p User --value verl-lab-tensorboard.service").stdout.strip() == "verl"
    # (the boxes share this machine's network: its listening sockets are the hub's)
    port = settings["port"]
    listen = [ln.split()[3] for ln in subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout.splitlines()
              if ln.strip() and ln.split()[3].endswith(f":{port}")]
    assert listen == [f"127.0.0.1:{port}"], listen


def test_controller_wrote_the_labs_scalars_from_the_boxes_scores(lab, tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tasks.facts.export import RunExports

    folder = lab.controller_cache / "tracking" / "lab" / OTHER / "verl-lab"
    acc = EventAccumulator(str(folder))
    acc.Reload()
    seen = lab.box(OTHER).ssh(RunExports().command(f"{ROOT}/train/checkpoints")).stdout
    assert SCORE_TAG in acc.Tags()["scalars"], f"{sorted(acc.Tags()['scalars'])}; the box has: {seen}"
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars(SCORE_TAG)] == [(0, 0.25), (5, 0.4)]


def test_offline_wandb_run_synced_by_the_controller_with_its_key(tracked, wandb_server):
    buckets = wandb_server.buckets()
    assert any(b.get("project") == "verl-lab" and b.get("displayName") == RUNS[OTHER] for b in buckets), buckets
    rows = wandb_server.history_rows()
    assert [r["_step"] for r in rows if "critic/score/mean" in r] == [1, 2, 3, 4, 5], rows[:2]
    assert all(tag in rows[0] for tag in VERL_TAGS), sorted(rows[0])
    assert wandb_server.completed() and wandb_server.keys_used() == {KEY}
    assert KEY not in tracked.output
    SYNCED_RUNS[:] = wandb_server.runs()
    assert len(SYNCED_RUNS) == 1
    assert ARGV_HITS == [], "the key was in a process's argv during the train or tracking deploy"


@pytest.fixture(scope="module")
def tunnel(lab, settings, tracked):
    """deploy/status.py's line: in the lab no tunnel (the boxes share this machine's network, where the hub's
    TensorBoard holds the port: a tunnel to it fails, "Address already in use"), the address to open instead.
    The SSH tunnel status prints to a hub elsewhere (tasks.tracking.hub.tunnel_command, from the hub's
    inventory data) is still opened here, its local port moved, and the page read through it."""
    from tasks.tracking.hub import tunnel_command

    res = lab.deploy("deploy/status.py", per_host=settings["per_host"], mode="text", timeout=600)
    line = next((ln for ln in res.output.splitlines() if ln.startswith("The lab's TensorBoard on ")), None)
    assert line, res.tail()
    port = settings["port"]
    assert line == (f"The lab's TensorBoard on {HUB}: open http://127.0.0.1:{port}/ (no tunnel needed: this machine "
                    f"shares {HUB}'s loopback, as the lab in a box does)"), line
    urllib.request.urlopen(f"http://127.0.0.1:{port}/data/logdir", timeout=10).read()
    box = lab.box(HUB)
    command = tunnel_command(HUB, {"ssh_hostname": "127.0.0.1", "ssh_user": "root", "ssh_port": box.port,
                                   "ssh_key": str(lab.key), "ssh_known_hosts_file": str(lab.known_hosts)},
                             port, "127.0.0.1")
    assert command.startswith(f"ssh -N -L {port}:127.0.0.1:{port} ")
    local = free_port()
    argv = shlex.split(command.replace(f"-L {port}:", f"-L {local}:", 1))
    argv[1:1] = ["-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{local}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/data/logdir", timeout=5).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"tunnel {argv}: {proc.stderr.read().decode()[-800:]}") from None
            time.sleep(1)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def runs(url: str) -> list[str]:
    return json.loads(urllib.request.urlopen(f"{url}/data/runs", timeout=10).read())


def scalars(url: str, run: str, tag: str) -> list:
    q = urllib.parse.urlencode({"run": run, "tag": tag})
    return json.loads(urllib.request.urlopen(f"{url}/data/plugin/scalars/scalars?{q}", timeout=10).read())


def test_tensorboard_has_verls_scalars_and_the_labs(tunnel):
    # each box's own run, and its lab summary (box1: the plan's predicted peak; box2: also its GSM8K scores)
    assert sorted(runs(tunnel)) == sorted([f"{HUB}/{RUNS[HUB]}", f"{OTHER}/{RUNS[OTHER]}", f"{HUB}/verl-lab",
                                           f"{OTHER}/verl-lab"])
    assert [step for _, step, _ in scalars(tunnel, f"{OTHER}/{RUNS[OTHER]}", "critic/score/mean")] == [1, 2, 3, 4, 5]
    if recorded_run():      # the hub's own run is the real GPU run's event files: served as they were written
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(recorded_run()))
        acc.Reload()
        want = [(e.step, e.value) for e in acc.Scalars("critic/score/mean")]
        assert [(step, value) for _, step, value in scalars(tunnel, f"{HUB}/{RUNS[HUB]}", "critic/score/mean")] \
            == want
    assert [(s, round(v, 3)) for _, s, v in scalars(tunnel, f"{OTHER}/verl-lab", SCORE_TAG)] == [(0, 0.25), (5, 0.4)]
    assert scalars(tunnel, f"{OTHER}/verl-lab", "verl_lab/predicted_peak_mib")[0][2] > 0


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "Debian's chromium and chromium-driver are missing (.ci/run installs them)"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,2000"):
        options.add_argument(arg)
    d = webdriver.Chrome(service=Service(driver), options=options)
    yield d
    d.quit()


def coloured_pixels(png: bytes) -> int:
    """Pixels of a chart's canvas that are neither white nor grey: the runs' curves (the grid is grey)."""
    from PIL import Image

    raw = Image.open(io.BytesIO(png)).convert("RGB").tobytes()
    return sum(1 for i in range(0, len(raw), 3) if max(raw[i:i + 3]) - min(raw[i:i + 3]) > 20)


def test_browser_scalars_page_lists_verls_metrics_and_draws_the_curves(tunnel, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{tunnel}/#timeseries")
    wait = WebDriverWait(browser, 60)
    box = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "input[placeholder='Filter tags (regex)']")))
    wanted = [*VERL_TAGS, SCORE_TAG]
    box.send_keys("|".join(f"^{t}$" for t in wanted))

    def cards(driver):
        found = {c.find_element(By.CSS_SELECTOR, "[class*=title], .heading").text.replace("\n", ""): c
                 for c in driver.find_elements(By.CSS_SELECTOR, "scalar-card")}
        return found if set(wanted) <= set(found) else False

    found = wait.until(cards)
    for tag in wanted:
        canvas = found[tag].find_element(By.CSS_SELECTOR, "line-chart canvas")
        deadline = time.monotonic() + 30
        while (drawn := coloured_pixels(canvas.screenshot_as_png)) < 100 and time.monotonic() < deadline:
            time.sleep(1)
        assert drawn >= 100, f"{tag}: no curve drawn ({drawn} coloured pixels)"
    legend = browser.find_element(By.TAG_NAME, "body").text
    assert f"{OTHER}/{RUNS[OTHER]}" in legend and f"{HUB}/{RUNS[HUB]}" in legend


# ------------------------------------------------------------------ the edges: live curves, links, syncs


def scalar_points(steps, base: float) -> bytes:
    """Event records of ``critic/score/mean`` at ``steps``, as verl's SummaryWriter writes a scalar."""
    return b"".join(record(_event(time.time(), s, values=[scalar_value("critic/score/mean", base + s / 100)]))
                    for s in steps)


def unit_invocation(box) -> str:
    return box.ssh(f"systemctl show -p InvocationID --value {TB_UNIT}").stdout.strip()


def box2_event_file(lab) -> str:
    folder = f"{ROOT}/tracking/tensorboard/{RUNS[OTHER]}"
    names = lab.box(OTHER).ssh(f"cd {folder} && ls events.out.tfevents.*").stdout.split()
    return f"{folder}/{next(n for n in names if '.0.' not in n)}"


def wait_steps(url: str, run: str, want: list[int], seconds: float = 120) -> list[int]:
    """TensorBoard reloads every 30 s (the unit's --reload_interval): its steps of ``run`` once they are ``want``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            got = [step for _, step, _ in scalars(url, run, "critic/score/mean")]
        except OSError:
            got = []
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(3)


PLANT = """set -e
tb={tb}; run=$tb/{run}
printf %s {root_only} > /root/tracking-secret; chmod 600 /root/tracking-secret
printf %s {world} > /var/tmp/tracking-world; chmod 644 /var/tmp/tracking-world
runuser -u verl -- ln -sfn /root/tracking-secret $run/events.out.tfevents.0.to-root
runuser -u verl -- ln -sfn /var/tmp/tracking-world $run/events.out.tfevents.0.to-world
runuser -u verl -- sh -c 'printf %s {elsewhere} > {root}/home/notes'
runuser -u verl -- ln -sfn {root}/home/notes $run/events.out.tfevents.0.to-elsewhere
runuser -u verl -- ln -sfn /root $tb/linked-run
locked=$run/events.out.tfevents.0.locked
runuser -u verl -- sh -c 'printf %s {locked} > '$locked'; chmod 000 '$locked
printf %s {roots} > $run/events.out.tfevents.0.roots
runuser -u verl -- mkdir -p $tb/race-run
"""
# box2's train user swapping a file of its folder for a link to a file it may read, and back, without end
SWAP = ("cd {tb}/race-run && while :; do printf race-ok > r && mv -fT r events.out.tfevents.1.race; "
        "ln -sfn /var/tmp/tracking-world l && mv -fT l events.out.tfevents.1.race; done")


@pytest.fixture(scope="module")
def grown(lab, settings, tunnel):
    """After the first copy: box2's run goes on (3 steps appended to its event file, as verl appends them),
    while box2's train user has planted links, a root-owned file and a file it locked in its tracker folder
    and swaps a file for a link; then deploy/tracking.py again."""
    hub, other = lab.box(HUB), lab.box(OTHER)
    event = box2_event_file(lab)
    served = f"{SERVED}/{OTHER}/{event.split('/tracking/tensorboard/', 1)[1]}"
    before = {"inode": hub.ssh(f"stat -c %i {served}").stdout.strip(), "unit": unit_invocation(hub),
              "steps": [step for _, step, _ in scalars(tunnel, f"{OTHER}/{RUNS[OTHER]}", "critic/score/mean")]}
    with (other.root / event.lstrip("/")).open("ab") as f:      # the box's file grows in place, as verl's does
        f.write(scalar_points(range(6, 9), 0.5))
    tb = f"{ROOT}/tracking/tensorboard"
    other.ssh(PLANT.format(tb=tb, run=RUNS[OTHER], root=ROOT, root_only=PLANTED["root-only"],
                           world=PLANTED["world-readable"], elsewhere=PLANTED["elsewhere"], locked=PLANTED["locked"],
                           roots=PLANTED["roots"]))
    pid = other.ssh(f"setsid runuser -u verl -- sh -c {shlex.quote(SWAP.format(tb=tb))} </dev/null >/dev/null 2>&1 "
                    "& echo $!").stdout.strip()
    try:
        res = lab.deploy("deploy/tracking.py", per_host=settings["per_host"], mode="text", timeout=900)
    finally:
        other.ssh(f"kill -- -{pid}", check=False)
    assert res.rc == 0 and not res.failed_hosts, res.tail()
    return {"res": res, "served": served, "before": before}


def test_tensorboard_shows_the_points_added_after_the_first_copy(lab, tunnel, browser, grown):
    """The served unit as it ships, the file grown on the box after the first deploy: the second deploy
    appends the new bytes to the hub's file in place, TensorBoard reads them without a restart, and the
    browser's chart of critic/score/mean reaches the new last step."""
    hub = lab.box(HUB)
    assert grown["before"]["steps"] == [1, 2, 3, 4, 5]
    assert hub.ssh(f"stat -c %i {grown['served']}").stdout.strip() == grown["before"]["inode"], "not in place"
    pushed = next(ln for ln in grown["res"].output.splitlines() if "the hub serves" in ln)
    assert "0 replaced" in pushed and "0 removed" in pushed, pushed
    assert unit_invocation(hub) == grown["before"]["unit"], "the unit was restarted"
    assert wait_steps(tunnel, f"{OTHER}/{RUNS[OTHER]}", list(range(1, 9))) == list(range(1, 9))
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{tunnel}/#timeseries")
    wait = WebDriverWait(browser, 60)
    box = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "input[placeholder='Filter tags (regex)']")))
    box.send_keys("^critic/score/mean$")

    def last_step_shown(driver):
        for card in driver.find_elements(By.CSS_SELECTOR, "scalar-card"):
            ticks = [t.text for t in card.find_elements(By.CSS_SELECTOR, "line-chart-axis[axis='x'] text")]
            steps = [float(t) for t in ticks if t.replace(".", "", 1).isdigit()]
            if steps and max(steps) >= 8:
                return max(steps)
        return False

    assert wait.until(last_step_shown) >= 8      # with steps 1..5 the axis ended at 5.5


def test_root_reads_nothing_box2s_train_user_planted_or_swapped(lab, grown):
    """The collect runs the copy's read as verl (runuser) through O_NOFOLLOW descriptors, taking only files
    verl owns. Mutations that make it fail: ``runuser -u verl --`` dropped from tasks/tracking/copy.py
    ``read_command`` (the read runs as root: the collect refuses its stream, and without that check root
    reads the file verl locked); O_NOFOLLOW dropped from verl_lab_box/tracking_copy.py ``walk`` (the link to
    verl's file outside its tracker folder is followed); ``walk``'s owner check dropped (the root-owned file
    travels). The links to root's files stay refused with any one of the three in place."""
    cache = subprocess.run(["grep", "-rlaF", *sum((["-e", v] for v in PLANTED.values()), []),
                            str(lab.controller_cache)], capture_output=True, text=True).stdout
    assert cache == "", f"planted bytes reached the controller: {cache}"
    for box in (lab.box(HUB),):
        found = box.ssh(f"grep -rlaF {' '.join('-e ' + v for v in PLANTED.values())} {SERVED} || true").stdout
        assert found == "", f"planted bytes reached the hub: {found}"
    out = grown["res"].output
    assert "left out under" in out and "links" in out and "foreign_owner" in out and "unreadable" in out, out[-3000:]
    # what the swapping left: the race file travelled with its own bytes or not at all
    race = lab.controller_cache / "tracking" / "lab" / OTHER / "race-run" / "events.out.tfevents.1.race"
    assert not race.exists() or race.read_bytes() == b"race-ok"


def test_hub_served_copy_is_one_the_train_user_can_change_nothing_in(lab, settings, tracked):
    """The push writes as root into ``<lab_root>/tracking-lab``: root's, under root-owned parents, in no
    ReadWritePaths of the training unit. Mutation: ``served_dir`` back under ``<lab_root>/tracking`` (the
    train user's): it renames the served folder away and plants its own."""
    hub = lab.box(HUB)
    assert hub.stat(SERVED) == ("750", "root", "verl") and hub.stat(ROOT)[1] == "root"
    assert hub.stat(f"{SERVED}/{OTHER}")[1:] == ("root", "verl")
    unit = hub.read_text("/etc/systemd/system/verl-lab-train.service")
    paths = next(ln for ln in unit.splitlines() if ln.startswith("ReadWritePaths=")).split("=", 1)[1].split()
    assert not any(SERVED == p.lstrip("-") or SERVED.startswith(p.lstrip("-") + "/") for p in paths), paths
    for attempt in (f"mv {SERVED} {ROOT}/tracking/moved", f"ln -s /etc/cron.d {SERVED}/{OTHER}/planted",
                    f"touch {SERVED}/{OTHER}/planted", f"mv {SERVED}/{OTHER} {SERVED}/away"):
        res = hub.ssh(f"runuser -u verl -- {attempt}", check=False)
        assert res.returncode != 0, f"verl could: {attempt}"
    # the staging folder of the copy's streams: root's alone
    assert hub.stat(f"{ROOT}/cache/tracking") == ("700", "root", "root")
    assert hub.ssh(f"runuser -u verl -- ls {ROOT}/cache/tracking", check=False).returncode != 0
    assert hub.ssh("ls /etc/cron.d").stdout.split() == lab.box(OTHER).ssh("ls /etc/cron.d").stdout.split()


def test_a_replaced_file_is_served_after_the_unit_restarts(lab, settings, tunnel, grown):
    """box2's event file replaced by another (3 steps, a new inode): copied whole on both legs, and the
    push restarts the unit, whose loader kept the old file's bytes (tests/unit/test_tracking_tensorboard.py)."""
    hub, other = lab.box(HUB), lab.box(OTHER)
    event = box2_event_file(lab)
    before = unit_invocation(hub)
    fresh = other.root / (event.lstrip("/") + ".new")
    head = record(_event(time.time(), file_version="brain.Event:2"))
    fresh.write_bytes(head + scalar_points(range(1, 4), 0.9))
    other.ssh(f"chown verl:verl {event}.new && mv -f {event}.new {event}")
    res = lab.deploy("deploy/tracking.py", per_host=settings["per_host"], mode="text", timeout=900)
    assert res.rc == 0 and not res.failed_hosts, res.tail()
    pushed = next(ln for ln in res.output.splitlines() if "the hub serves" in ln)
    # (box2's event file, and the race file where the swapping left it regular again under a new inode)
    assert int(re.search(r"(\d+) replaced", pushed).group(1)) >= 1, pushed
    served = f"{SERVED}/{OTHER}/{event.split('/tracking/tensorboard/', 1)[1]}"
    assert hub.ssh(f"sha256sum < {served}").stdout == other.ssh(f"sha256sum < {event}").stdout
    assert unit_invocation(hub) != before, "the unit was not restarted"
    assert wait_steps(tunnel, f"{OTHER}/{RUNS[OTHER]}", [1, 2, 3]) == [1, 2, 3]


def synced_record(lab) -> dict:
    path = lab.controller_cache / "tracking" / "boxes" / OTHER / "wandb" / ".verl-lab-synced.json"
    return json.loads(path.read_text()) if path.is_file() else {}


@pytest.fixture(scope="module")
def refused_sync(lab, settings, wandb_server, grown):
    """box2 made a second offline run; the server refuses the sync (401), which wandb itself reports done."""
    run = verl_wandb_offline_run(MADE["python"], MADE["verl_root"], MADE["work"] / "wandb2",
                                 experiment=RUNS[OTHER] + "-again")
    place_as_verl_wrote(lab.box(OTHER), run, f"{ROOT}/tracking/wandb/wandb/{run.name}")
    wandb_server.refusing = True
    try:
        res = lab.deploy("deploy/tracking.py", per_host=settings["per_host"], mode="text", timeout=900)
    finally:
        wandb_server.refusing = False
    return {"res": res, "run": run.name, "record": synced_record(lab), "runs": wandb_server.runs()}


@pytest.fixture(scope="module")
def gone_box_synced(lab, settings, refused_sync):
    """deploy/tracking.py with box2 gone from the inventory (the hub alone)."""
    res = lab.deploy("deploy/tracking.py", per_host=settings["per_host"], hosts=[HUB], mode="text", timeout=900)
    assert res.rc == 0 and not res.failed_hosts, res.tail()
    return res


def test_offline_runs_synced_once_and_a_gone_boxs_runs_from_the_cache(lab, wandb_server, grown, refused_sync,
                                                                      gone_box_synced):
    """The first run: synced by the first deploy, not again by the three after it. The second: refused by
    the server (the syncing box fails, saying so; nothing recorded), then synced with box2 gone from the
    inventory, from the controller's cache, with the hub's settings; each run once, under its own id."""
    first = SYNCED_RUNS[0]
    res = refused_sync["res"]
    assert res.rc != 0 and res.failed_hosts == [HUB], res.tail()
    assert f"run {refused_sync['run']} not synced" in res.output
    assert refused_sync["run"] not in refused_sync["record"] and len(refused_sync["record"]) == 1
    assert refused_sync["runs"] == [first], "a run synced again, or the refused one counted"
    assert "box2's wandb runs synced: 1 tried, all done" in gone_box_synced.output, gone_box_synced.tail()
    runs = wandb_server.runs()
    assert runs[0] == first and len(runs) == 2 and refused_sync["run"].endswith(runs[1]), runs
    assert sorted(synced_record(lab)) == sorted([*refused_sync["record"], refused_sync["run"]])
    assert wandb_server.keys_used() == {KEY}
    SYNCED_RUNS[:] = runs


def test_a_box_that_goes_away_keeps_its_curves(lab, settings, tunnel, wandb_server, gone_box_synced):
    other = lab.box(OTHER)
    other.ssh("systemctl stop ssh.socket ssh.service >/dev/null 2>&1 &", check=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", other.port)) != 0:
                break
        time.sleep(1)
    res = lab.deploy("deploy/tracking.py", per_host=settings["per_host"], mode="text", timeout=600)
    assert "box2" in res.output and "lab's TensorBoard" in res.output, res.tail()
    assert lab.box(HUB).ssh("systemctl is-active verl-lab-tensorboard.service").stdout.strip() == "active"
    assert f"{OTHER}/{RUNS[OTHER]}" in runs(tunnel)
    kept = lab.box(HUB).ssh(f"ls {SERVED}/{OTHER}/{RUNS[OTHER]}").stdout
    assert "events.out.tfevents." in kept, "the hub dropped the files of the box that went away"
    # (box2's event file was replaced by one of 3 steps: test_a_replaced_file_is_served_after_the_unit_restarts)
    assert len(scalars(tunnel, f"{OTHER}/{RUNS[OTHER]}", "critic/score/mean")) == 3
    assert wandb_server.runs() == [SYNCED_RUNS[0], SYNCED_RUNS[1]], "a run was synced again"


def test_pyinfra_diff_of_a_key_change_prints_no_key(lab, settings, trained):
    """The keys file changed (a new key), deploy/train.py run with pyinfra's --diff on the hub: pyinfra prints
    the diffs of the files the change touches (the unit's digest line) and none of either key. Mutation:
    ``secret=False`` in tasks/tracking/train.py ``tracking_wanted`` (files.put): ``- WANDB_API_KEY=<old>`` and
    ``+ WANDB_API_KEY=<new>`` on the screen."""
    keys = Path(settings["per_host"][HUB]["tracking"]["keys_file"])
    keys.write_text(f"WANDB_API_KEY={KEY2}\n")
    hub = lab.box(HUB)
    with argv_sampled():
        res = lab.deploy("deploy/train.py", per_host=settings["per_host"], hosts=[HUB], mode="text",
                         extra_args=["--diff"], timeout=900)
    assert res.rc == 0 and not res.failed_hosts, res.tail()
    assert "Will modify" in res.output and "verl-lab-train.service" in res.output, "pyinfra printed no diff"
    assert KEY not in res.output and KEY2 not in res.output
    path = f"{ROOT}/train/tracking-keys.env"
    assert hub.read_text(path) == f"WANDB_API_KEY={KEY2}\n" and hub.stat(path) == ("400", "verl", "verl")
    assert not hub.exists(path + ".part")
    assert ARGV_HITS == [], "a key was in a process's argv during the deploy"
    journal = hub.ssh(f"journalctl --no-pager | grep -cF -e {KEY} -e {KEY2} || true").stdout.strip()
    assert journal == "0"
