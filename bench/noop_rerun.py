"""No-op re-run: a deploy on already provisioned boxes vs the floor of pyinfra itself.

    python bench/noop_rerun.py [--boxes N] [--repeat K] [--stages full|nonenv]

Boots N P40 boxes (P40: vLLM is skipped, so no vLLM wheel stand-in is needed), converges them
with every stage's stand-ins, then times K interleaved rounds of
  floor : `pyinfra -y INV fact server.Hostname` (connect + one trivial fact per host)
  no-op : `pyinfra -y INV deploy/full.py`        (same inventory, same ssh settings)
and one more no-op run through bench/counted_pyinfra.py that counts the remote commands per
host, per stage and per fact. Targets: no-op <= 3x the floor, zero changed operations.
Needs root (lab in a box). Writes bench/results/noop_rerun.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (  # noqa: E402
    RESULTS,
    Pipeline,
    floor_args,
    interleave,
    log,
    ratio,
    render_table,
    run_pyinfra,
    summary,
    write_result,
)
from tests.lab import BoxSpec, Lab  # noqa: E402

TARGET_RATIO = 3.0


def converge(pipe: Pipeline, hosts: list[str]) -> dict:
    """Bring fresh boxes to the provisioned state; returns the wall times of the converge runs."""
    times = {}
    if pipe.stages == "full":
        # deploy/full.py on a fresh box stops at the data stage's env check (made while the
        # operations are prepared, before the env stage has run): build the env alone first
        run = run_pyinfra(pipe.lab, ["deploy/env.py"], pipe.data, hosts, tag="converge-env", timeout=1800)
        run.result.assert_ok()
        times["deploy/env.py"] = run.seconds
    else:
        for h in hosts:
            pipe.prepare_box(h)
    # the first box alone fills the controller cache: the data stage's controller download
    # (verl_lab_box/hf_snapshot.py, relay mode) blocks the pyinfra process in flock() when two hosts
    # fetch the same snapshot at once
    for tag, group in (("first", hosts[:1]), ("all", hosts)):
        run = run_pyinfra(pipe.lab, [pipe.deploy_file], pipe.data, group, tag=f"converge-{tag}", timeout=1800)
        run.result.assert_ok()
        times[f"{pipe.deploy_file} ({tag})"] = run.seconds
    return times


def noop_vs_floor(pipe: Pipeline, hosts: list[str], repeat: int) -> dict:
    changed = []

    def floor():
        run = run_pyinfra(pipe.lab, floor_args(), pipe.data, hosts, tag="floor")
        run.result.assert_ok()
        return {"seconds": run.seconds}

    def noop():
        run = run_pyinfra(pipe.lab, [pipe.deploy_file], pipe.data, hosts, tag="noop")
        run.result.assert_ok()
        changed.append({"total": run.result.changed, "ops": run.result.changed_ops})
        return {"seconds": run.seconds}

    times = interleave({"floor": floor, "noop": noop}, repeat)
    return {"times": times, "changed": changed}


def counted(pipe: Pipeline, hosts: list[str]) -> dict:
    noop = run_pyinfra(pipe.lab, [pipe.deploy_file], pipe.data, hosts, count=True, tag="counted-noop")
    noop.result.assert_ok()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "noop_rerun-commands.jsonl", "w") as fh:      # every command, for reading
        for host in hosts:
            for rec in noop.log.commands.get(host, []):
                fh.write(json.dumps(rec) + "\n")
    floor = run_pyinfra(pipe.lab, floor_args(), pipe.data, hosts, count=True, tag="counted-floor")
    return {"noop": noop.commands, "floor": floor.commands, "noop_changed": noop.result.changed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--boxes", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stages", choices=("full", "nonenv"), default="full")
    args = ap.parse_args(argv)
    hosts = [f"noop{i + 1}" for i in range(args.boxes)]
    with Lab() as lab:
        lab.boot([BoxSpec(h, gpu="p40") for h in hosts])
        pipe = Pipeline(lab, args.stages)
        try:
            log(f"converging {len(hosts)} boxes with {pipe.deploy_file}")
            conv = converge(pipe, hosts)
            log(f"converged: {conv}; timing {args.repeat} interleaved rounds")
            timed = noop_vs_floor(pipe, hosts, args.repeat)
            counts = counted(pipe, hosts)
        finally:
            pipe.close()
    floor_s, noop_s = summary(timed["times"]["floor"]), summary(timed["times"]["noop"])
    x = ratio(noop_s["median"], floor_s["median"])
    changed = [c["total"] for c in timed["changed"]]
    rows = [["floor: fact server.Hostname", floor_s["median"], floor_s["min"], floor_s["max"], 1.0, "-"],
            [f"no-op: {pipe.deploy_file}", noop_s["median"], noop_s["min"], noop_s["max"], x, max(changed)]]
    print(f"\nNo-op re-run, {len(hosts)} boxes, {args.repeat} interleaved rounds (seconds)")
    print(render_table(["run", "median", "min", "max", "x floor", "changed"], rows))
    print(f"target: <= {TARGET_RATIO}x floor and 0 changed -> "
          f"{'MET' if x <= TARGET_RATIO and max(changed) == 0 else 'MISSED'}")
    host0 = hosts[0]
    per = counts["noop"].get(host0, {})
    print(f"\nRemote commands per host on a no-op re-run ({host0}): {per.get('commands')} "
          f"(floor: {counts['floor'].get(host0, {}).get('commands')}), uploads {per.get('uploads')}")
    print(render_table(["stage", "commands"], sorted(per.get("by_stage", {}).items())))
    print(render_table(["fact", "commands"], sorted(per.get("by_fact", {}).items(), key=lambda kv: -kv[1])))
    print(f"slowest commands on {host0} (their sum: {per.get('command_seconds')}s):")
    print(render_table(["s", "stage", "fact", "command"],
                       [[r["seconds"], r["stage"], r["fact"], " ".join((r["command"] or "").split())[:90]]
                        for r in per.get("slowest", [])]))
    print(f"facts asked more than once with the same command on {host0}:")
    print(render_table(["times", "fact: command"], [[n, " ".join(k.split())[:110]]
                                                    for k, n in sorted(per.get("repeated_facts", {}).items())]))
    path = write_result("noop_rerun", {
        "boxes": len(hosts), "repeat": args.repeat, "stages": args.stages, "deploy_file": pipe.deploy_file,
        "converge_s": conv, "floor": floor_s, "noop": noop_s, "ratio": x, "target_ratio": TARGET_RATIO,
        "changed_per_run": changed, "samples": timed["times"], "commands": counts,
        "met": x <= TARGET_RATIO and max(changed) == 0})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
