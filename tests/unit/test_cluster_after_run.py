"""How a Ray cluster run ends (issue 34): the launcher's after-run gathers the last save on the head
(``cluster-gather``) before the export and the scores, and fails the unit's way when it cannot.

Pure: ``verl_lab_box.cluster_gather.plan_fetch`` on the listings nodes answer (what the head copies,
and every reason it refuses: a rank on no node, two world sizes, a node that is down, a stale copy).
Plumbing: the real launcher with stand-ins of verl's trainer, the gather, the export and the score
(tests/unit/test_launcher_after_run.py's): the gather runs with ray.env's environment, before the
export; its failure ends the launcher with AFTER_RUN_FAILED and exports nothing; a box alone never
gathers. The gather over real Ray nodes with their own disks, and the real export and score on the
head after it: tests/unit/test_cluster_two_disks.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.unit.test_launcher_after_run import STEP, run  # noqa: F401 - the fixture
from tests.unit.test_train_launcher import box  # noqa: F401 - the fixture
from verl_lab_box.cluster_gather import plan_fetch

HEAD, WK = "10.0.0.5", "10.0.0.7"
SHARD = "model_world_size_2_rank_{}.pt"
CONFIG, HF = "fsdp_config.json", "huggingface/config.json"


def _node(host, *names, ident=(100, 7)):
    return {"host": host, "files": {n: list(ident) for n in names}}


def test_the_head_copies_what_only_another_node_holds():
    """rank 0 (with fsdp_config.json and huggingface/) on the worker, rank 1 on the head: the worker's
    rank 0 shard and rank 0's side files are copied; the head's own shard is not."""
    nodes = {HEAD: _node("head", SHARD.format(1)),
             WK: _node("wk1", SHARD.format(0), "fsdp_config.json", "huggingface/config.json",
                       "huggingface/tokenizer.json")}
    fetch, problems = plan_fetch(HEAD, nodes, 4, 2)
    assert problems == []
    assert [(f["name"], f["from"]) for f in fetch] == [(SHARD.format(0), WK), ("fsdp_config.json", WK),
                                                       ("huggingface/config.json", WK),
                                                       ("huggingface/tokenizer.json", WK)]
    assert fetch[0]["bytes"] == 100 and fetch[0]["mtime_ns"] == 7
    # the head holds all of it already (a re-run): nothing to copy
    nodes[HEAD]["files"].update(nodes[WK]["files"])
    assert plan_fetch(HEAD, nodes, 4, 2) == ([], [])


def test_a_rank_on_no_node_is_named_with_what_each_node_holds():
    nodes = {HEAD: _node("head", SHARD.format(1)), WK: {"host": "wk1", "files": None}}
    fetch, problems = plan_fetch(HEAD, nodes, 4, 2)
    assert problems[0] == (f"{SHARD.format(0)} of step 4 is on no node (node {HEAD} (head): ranks 1; node {WK} (wk1): "
                           "no global_step_4/actor)")
    assert any(p.startswith("fsdp_config.json of step 4 is on no node") for p in problems)
    # a node that left: the plan's count says so
    _, down = plan_fetch(HEAD, {HEAD: nodes[HEAD]}, 4, 2)
    assert down[0].endswith("1 of the plan's 2 nodes answered: a node that is down or has left the cluster holds it "
                            "(journalctl -u verl-lab-ray.service there)")


def test_shards_of_two_world_sizes_or_none_at_all_are_refused():
    nodes = {HEAD: _node("head", "model_world_size_4_rank_1.pt"), WK: _node("wk1", SHARD.format(0))}
    _, problems = plan_fetch(HEAD, nodes, 4, 2)
    assert problems[0].startswith("step 4 has shards of 2 world sizes (2, 4): saves of two runs")
    _, none = plan_fetch(HEAD, {HEAD: _node("head"), WK: _node("wk1")}, 4, 2)
    assert none[0] == f"no node holds a model shard of step 4 (node {HEAD} (head): ranks none; node {WK} (wk1): ranks none)"


def test_copies_that_differ_are_refused_unless_the_heads_was_gathered():
    """The same rank's shard on two nodes with other bytes: a stale copy; named, never chosen. A copy an
    earlier gather left on the head yields to the node's own file (copied again where it changed)."""
    side = ("fsdp_config.json", "huggingface/config.json")
    nodes = {HEAD: _node("head", SHARD.format(1), SHARD.format(0), *side),
             WK: _node("wk1", SHARD.format(0), ident=(100, 9))}
    _, problems = plan_fetch(HEAD, nodes, 4, 2)
    assert problems == [f"{SHARD.format(0)} of step 4 differs between nodes: node {HEAD} (head) 100 bytes, mtime 7, "
                        f"node {WK} (wk1) 100 bytes, mtime 9: a stale copy from a run whose ranks were placed otherwise; "
                        "remove it there"]
    fetch, problems = plan_fetch(HEAD, nodes, 4, 2, gathered=[SHARD.format(0)])
    assert problems == [] and [(f["name"], f["from"], f["mtime_ns"]) for f in fetch] == [(SHARD.format(0), WK, 9)]
    nodes[WK]["files"][SHARD.format(0)] = [100, 7]            # the same file: nothing to copy again
    assert plan_fetch(HEAD, nodes, 4, 2, gathered=[SHARD.format(0)]) == ([], [])


def test_the_head_must_be_a_node_of_the_cluster():
    assert plan_fetch("10.0.0.9", {WK: _node("wk1")}, 4, 2) == (
        [], ["the head 10.0.0.9 is not among the cluster's nodes (10.0.0.7)"])


# ---------------------------------------------------------------- the launcher's cluster branch

GATHER = """\
import json, os, sys
with open(os.environ["RECORD"], "a") as fh:
    fh.write(json.dumps({"gather": sys.argv[1:], "ray_address": os.environ.get("RAY_ADDRESS")}) + "\\n")
if os.environ.get("FAIL") == "gather":
    print("verl-lab cluster gather FAILED (step 3, head 10.0.0.5): model_world_size_2_rank_0.pt of step 3 is on "
          "no node (...)", flush=True)
    sys.exit(1)
"""


@pytest.fixture
def cluster_run(run):  # noqa: F811
    """The launcher's train dir with a two-node plan, ray.env and a stand-in cluster-gather beside the plan."""
    launch, calls, layout = run
    plan_file = Path(layout.plan_file)
    plan = json.loads(plan_file.read_text())
    for o in plan["launch"]["overrides"]:
        if o["override"].startswith("trainer.nnodes="):
            o["override"] = "trainer.nnodes=2"
    plan_file.write_text(json.dumps(plan))
    assert "trainer.nnodes=2" in [o["override"] for o in plan["launch"]["overrides"]]
    (plan_file.parent / "ray.env").write_text("# Ray\nRAY_ADDRESS=10.0.0.5:6379\n")
    (plan_file.parent / "cluster-gather").write_text(GATHER)
    return launch, calls, layout


def test_a_finished_cluster_run_is_gathered_on_the_head_then_exported_and_scored(cluster_run):
    launch, calls, layout = cluster_run
    out = launch("--no-preflight")
    assert out.returncode == 0, out.stdout + out.stderr
    order = [k for c in calls() for k in c if k in ("main_ppo", "gather", "export", "score")]
    assert order == ["main_ppo", "gather", "export", "score", "score"]
    gather = next(c for c in calls() if "gather" in c)
    assert gather["gather"] == ["--plan", layout.plan_file, "--step", str(STEP)]
    assert gather["ray_address"] == "10.0.0.5:6379"               # ray.env's, for a run by hand too
    ram = json.loads(Path(layout.plan_file).read_text())["launch"]["checkpoints"]["export_host_ram"]
    assert next(c["export"] for c in calls() if "export" in c) == [
        "--checkpoint-dir", layout.checkpoint_dir, "--step", str(STEP), "--host-ram-mib", str(ram["gpu_free_mib"]),
        "--final"]
    assert "not exported" not in out.stdout + out.stderr
    on_demand = launch("--export", "--no-score")                  # deploy/export.py's way: the same gather first
    assert on_demand.returncode == 0 and [k for c in calls()[-2:] for k in c if k in ("gather", "export")] == [
        "gather", "export"]


def test_a_cluster_run_that_cannot_be_gathered_fails_the_unit_and_exports_nothing(cluster_run):
    launch, calls, _ = cluster_run
    out = launch("--no-preflight", FAIL="gather")
    assert out.returncode == 70, out.stdout + out.stderr           # AFTER_RUN_FAILED: the unit is failed, not restarted
    assert [k for c in calls() for k in c if k in ("main_ppo", "gather", "export", "score")] == ["main_ppo", "gather"]
    assert "verl-lab cluster gather FAILED (step 3, head 10.0.0.5)" in out.stdout
    assert "the cluster's step 3 cannot be gathered on this head (cluster-gather exit 1" in out.stderr


def test_a_cluster_run_that_saved_but_left_no_tracker_on_the_head_fails(cluster_run, box):  # noqa: F811
    """verl without patch 0010 writes the tracker where Ray put its TaskRunner: the head finds none though the plan
    saves. Never a silent "no checkpoint": exit 70, naming the patch. With saves turned off by hand, nothing to do."""
    launch, calls, layout = cluster_run
    plan = json.loads(Path(layout.plan_file).read_text())
    assert any(o["override"].startswith("trainer.save_freq=") and int(o["override"].split("=")[1]) > 0
               for o in plan["launch"]["overrides"])
    (box["tmp"] / "site" / "verl" / "trainer" / "main_ppo.py").write_text("import sys\nsys.exit(0)\n")   # no tracker here
    out = launch("--no-preflight")
    assert out.returncode == 70, out.stdout + out.stderr
    assert "has no latest_checkpointed_iteration.txt: verl's TaskRunner ran on another node (is patch 0010" in out.stderr
    assert not [c for c in calls() if "gather" in c or "export" in c]
    off = launch("--no-preflight", "--", "trainer.save_freq=-1")
    assert off.returncode == 0 and "no checkpoint in" in off.stdout, off.stdout + off.stderr


def test_a_workers_launcher_does_not_export_and_says_where(cluster_run):
    """train-launcher --export by hand on a worker (its ray.env: its own node address, the head's RAY_ADDRESS): it
    would gather onto the worker's disk; it names the head instead, gathers and exports nothing."""
    launch, calls, layout = cluster_run
    (Path(layout.plan_file).parent / "ray.env").write_text("RAY_ADDRESS=10.0.0.5:6379\nVERL_LAB_NODE_IP=10.0.0.7\n")
    out = launch("--export")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "this box (10.0.0.7) is a worker of the Ray cluster whose head is 10.0.0.5" in out.stderr
    assert not [c for c in calls() if "gather" in c or "export" in c]


def test_a_box_alone_never_gathers(run):  # noqa: F811
    launch, calls, layout = run
    (Path(layout.plan_file).parent / "cluster-gather").write_text(GATHER)
    out = launch("--no-preflight")
    assert out.returncode == 0 and not [c for c in calls() if "gather" in c]


# ---------------------------------------------------------------- the disk plan

def test_the_disk_plan_counts_the_shards_a_cluster_head_gathers():
    """tasks/checkpoints.py: a node of 2 GPUs in a world of 4 (two nodes) holds 2 ranks' files; its head copies the
    other node's 2 actor model shards for the export: counted in the disk a run needs and in what the launcher's
    disk check reads as the export's need. A box alone gathers nothing."""
    from tasks import checkpoints as ck
    from tasks.memory import ModelShape

    shape = ModelShape(layers=24, hidden=896, heads=14, kv_heads=2, head_dim=64, ffn=4864, vocab=151936,
                       tied_embeddings=True)
    cluster = ck.plan_checkpoints(shape, critic=True, actor_layout="fsdp", world_size=4, param_dtype="fp32",
                                  side_files_bytes=0)
    actor = cluster.save.roles[0]
    assert cluster.gather_bytes(2) == 2 * max(actor.model_bytes) >= sum(actor.model_bytes[2:])
    assert cluster.disk_bytes(2) == 2 * cluster.save.box_bytes(2) + cluster.export_bytes + cluster.gather_bytes(2)
    launch = cluster.launch("/c", 2)
    assert launch["export_bytes"] == cluster.export_bytes + launch["gather_bytes"] and launch["gather_bytes"] > 0
    alone = ck.plan_checkpoints(shape, critic=True, actor_layout="fsdp", world_size=2, param_dtype="fp32",
                                side_files_bytes=0)
    assert alone.gather_bytes(2) == 0 and alone.launch("/c", 2)["export_bytes"] == alone.export_bytes


# ---------------------------------------------------------------- what status says of a cluster run that cannot export

def test_status_shows_a_cluster_run_that_could_not_gather_as_failed_with_why():
    """deploy/status.py's row for the head: the unit ended by the launcher's 70 is failed (not finished), the
    doctor's verdict (the same calls deploy/status.py makes) names the rule and the file, and no model is shown."""
    from tasks.doctor import diagnose, render
    from tasks.status import box_status, gsm8k_words, render_rows

    journal = (Path(__file__).resolve().parents[1] / "fixtures" / "doctor" / "cluster-save-not-whole.log").read_text()
    unit = {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "exit-code",
            "NRestarts": "0", "ExecMainStartTimestampMonotonic": "91234567"}
    diag = diagnose("head", {"journal": journal}, None, failed=True)
    verdict = "\n".join(render(diag).splitlines()[1:])
    exports = {"latest_step": 3, "finished_step": 3, "base": None, "exports": []}
    row = box_status("head", {}, unit, journal, None, verdict, "", exports)
    assert row["unit"] == "failed" and gsm8k_words(row["gsm8k"]) == "-"
    assert "cluster-save-not-whole" in verdict and "model_world_size_2_rank_0.pt of step 3 is on no node" in verdict
    assert "systemctl start verl-lab-ray.service" in verdict
    assert "failed" in render_rows([row]).splitlines()[1]


# ---------------------------------------------------------------- one file's copy (Ray's calls stood in by local ones)

class _Local:
    """A pinned Ray task stood in by a local call: ``.remote(...)`` returns the result as its ref."""

    def __init__(self, fn, log=None):
        self.fn, self.log = fn, log

    def remote(self, *args):
        if self.log is not None:
            self.log.append(args)
        return self.fn(*args)


def _item(path: Path) -> dict:
    st = path.stat()
    return {"name": path.name, "from": WK, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns - 5_000_000_000}


def test_a_file_is_copied_in_order_chunk_by_chunk_with_the_nodes_mtime(tmp_path, monkeypatch):
    """copy_file with 10-byte reads, 4 in flight, over 95 bytes: every chunk once, in order, the node's mtime kept,
    no part file left; the same path read (the node's) and written (the head's) as on two disks."""
    from types import SimpleNamespace

    from verl_lab_box import cluster_gather as cg

    monkeypatch.setattr(cg, "CHUNK", 10)
    src = tmp_path / "node" / SHARD.format(0)
    src.parent.mkdir()
    src.write_bytes(bytes(range(95)))
    item, reads = _item(src), []
    dest = tmp_path / "head" / "actor" / SHARD.format(0)
    ray = SimpleNamespace(get=lambda ref, timeout: ref)
    node = str(src)
    got = cg.copy_file(ray, item, str(dest), _Local(lambda p, off, n: cg.read_chunk(node, off, n), reads),
                       _Local(lambda p: cg.file_sha256(node)), cg.Deadline(60))
    assert dest.read_bytes() == src.read_bytes() and dest.stat().st_mtime_ns == item["mtime_ns"]
    assert [r[1] for r in reads] == list(range(0, 95, 10)) and got["sha256"] == cg.file_sha256(str(src))
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]


def test_a_copy_whose_sha256_differs_from_the_nodes_is_not_kept(tmp_path):
    """The node's file changed while it was read (its sha256 is not the copy's): an error naming the file and the
    node, and neither the file nor its part file on the head."""
    from types import SimpleNamespace

    from verl_lab_box import cluster_gather as cg

    src = tmp_path / SHARD.format(0)
    src.write_bytes(b"x" * 1000)
    dest = tmp_path / "head" / SHARD.format(0)
    with pytest.raises(OSError, match=f"{SHARD.format(0)} from node {WK}: 1000 bytes, sha256 .*the node's file 1000 "
                                      "bytes, sha256 0000000000000000: changed while copied"):
        cg.copy_file(SimpleNamespace(get=lambda ref, timeout: ref), _item(src), str(dest),
                     _Local(lambda p, off, n: cg.read_chunk(str(src), off, n)), _Local(lambda p: "0" * 64), cg.Deadline(60))
    assert not dest.parent.exists() or list(dest.parent.iterdir()) == []


def _ray_standin(hangs=()):
    """Ray's ``get`` and its two exceptions, stood in: a ref in ``hangs`` never arrives (``get`` waits out its
    timeout, as Ray's does for a task pinned to a node that hangs)."""
    from types import SimpleNamespace

    class RayError(Exception):
        pass

    class GetTimeoutError(RayError):
        pass

    def get(ref, timeout):
        if ref in hangs:
            raise GetTimeoutError(f"get timed out after {timeout} s")
        return ref

    return SimpleNamespace(get=get, exceptions=SimpleNamespace(RayError=RayError, GetTimeoutError=GetTimeoutError))


def test_the_copy_is_judged_by_the_file_on_disk_not_the_bytes_received(tmp_path, monkeypatch):
    """The bytes came whole, the file the disk holds after fsync is not (a short write stood in by a truncating
    fsync): the copy is refused and nothing is kept. Mutation tried: hashing the bytes as they came (the gather
    before issue 41) keeps the cut file as the shard."""
    from verl_lab_box import cluster_gather as cg

    src = tmp_path / SHARD.format(0)
    src.write_bytes(b"y" * 1000)
    real_fsync = os.fsync
    monkeypatch.setattr(cg.os, "fsync", lambda fd: (os.ftruncate(fd, 600), real_fsync(fd)))
    dest = tmp_path / "head" / SHARD.format(0)
    with pytest.raises(OSError, match="600 bytes, sha256 .* on this disk, the node's file 1000 bytes"):
        cg.copy_file(_ray_standin(), _item(src), str(dest), _Local(lambda p, off, n: cg.read_chunk(str(src), off, n)),
                     _Local(lambda p: cg.file_sha256(str(src))), cg.Deadline(60))
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def test_each_process_writes_its_own_part_file(tmp_path):
    """Another gather's part file of the same shard (pid 99999) is neither written nor removed by this one."""
    from verl_lab_box import cluster_gather as cg

    src = tmp_path / SHARD.format(0)
    src.write_bytes(b"z" * 300)
    dest = tmp_path / "head" / SHARD.format(0)
    dest.parent.mkdir()
    other = dest.parent / f"{dest.name}{cg.PART}.99999"
    other.write_bytes(b"theirs")
    seen, ray = [], _ray_standin()
    get = ray.get

    def listing_get(ref, timeout):           # what the head's folder holds while the chunks are written
        seen.extend(sorted(x.name for x in dest.parent.iterdir()))
        return get(ref, timeout)

    ray.get = listing_get
    cg.copy_file(ray, _item(src), str(dest), _Local(lambda p, off, n: cg.read_chunk(str(src), off, n)),
                 _Local(lambda p: cg.file_sha256(str(src))), cg.Deadline(60))
    assert dest.read_bytes() == src.read_bytes() and other.read_bytes() == b"theirs"
    assert f"{dest.name}{cg.PART}.{os.getpid()}" in seen
    assert cg.remove_parts(str(dest.parent)) == [other.name] and not other.exists()
    assert not cg.wanted(f"huggingface/config.json{cg.PART}.12")


def test_a_gather_that_fails_half_way_leaves_what_it_copied_on_record_and_the_next_goes_on(tmp_path):
    """Rank 0 copied, the node hangs on rank 1 (its read never arrives within the time left): the gather stops
    with a line naming the node and the file, its record holds rank 0. The node then saves step 4 again (rank 0's
    mtime moves on): the next gather's plan copies rank 0 anew instead of refusing the head's copy as a stale one.
    Mutation tried: writing the record only when the step is whole (the gather before issue 41): the next plan
    refuses rank 0 as differing between nodes."""
    from verl_lab_box import cluster_gather as cg

    node, actor = tmp_path / "node", tmp_path / "head" / "actor"
    node.mkdir()
    for r in (0, 1):
        (node / SHARD.format(r)).write_bytes(bytes([r]) * 100)
    fetch = [{**_item(node / SHARD.format(r)), "name": SHARD.format(r)} for r in (0, 1)]
    hang = object()

    def pinned(fn, ip):
        if fn is cg.read_chunk:
            return _Local(lambda p, off, n: hang if p.endswith(SHARD.format(1)) else
                          cg.read_chunk(str(node / os.path.basename(p)), off, n))
        return _Local(lambda p: cg.file_sha256(str(node / os.path.basename(p))))

    record = {"step": 4, "head": HEAD, "nodes": {}, "copied": [], "bytes": 0, "complete": False}
    copied, problem = cg.copy_fetched(_ray_standin(hangs=(hang,)), fetch, str(actor), pinned, cg.Deadline(5), record,
                                      {WK: {"host": "wk1"}})
    assert [c["name"] for c in copied] == [SHARD.format(0)]
    assert problem.startswith(f"node {WK} did not answer within 5 s (copying {SHARD.format(1)})")
    on_record = json.loads((actor / cg.RECORD).read_text())
    assert [c["name"] for c in on_record["copied"]] == [SHARD.format(0)] and on_record["complete"] is False
    head_copy = actor / SHARD.format(0)
    saved_again = [100, head_copy.stat().st_mtime_ns + 10 ** 9]          # the node's rank 0, saved again
    nodes = {HEAD: {"host": "head", "files": {SHARD.format(0): [100, head_copy.stat().st_mtime_ns], CONFIG: [1, 1],
                                              HF: [1, 1]}},
             WK: {"host": "wk1", "files": {SHARD.format(0): saved_again, SHARD.format(1): [100, 5]}}}
    fetch, problems = plan_fetch(HEAD, nodes, 4, 2, [c["name"] for c in on_record["copied"]])
    assert problems == [] and sorted(f["name"] for f in fetch) == [SHARD.format(0), SHARD.format(1)]


def test_a_cluster_plan_gives_its_gather_a_timeout_and_a_box_alone_none():
    """plan.json's ``launch.gather_timeout_s`` (tasks/train.py): the after-run passes it as cluster-gather's
    ``--timeout`` (every call to a node within it); a box alone never gathers, its plan names none."""
    from dataclasses import replace

    from tasks.plan import GpuTarget, cluster_plan, doc_workload
    from tasks.train import GATHER_TIMEOUT_S
    from tests.unit.test_train_launcher import layout_for, settings_for

    alone = layout_for(settings_for())
    assert "gather_timeout_s" not in alone.launch()
    t4 = GpuTarget("Tesla T4", "7.5", 15360, 1)
    two = replace(alone, plan=cluster_plan({"a": t4, "b": t4}, doc_workload()))
    assert two.nnodes == 2 and two.launch()["gather_timeout_s"] == GATHER_TIMEOUT_S == 600
