"""Fleet scale: a fresh converge and the no-op re-run on 1, 2, 4 and 8 boxes.

    python bench/fleet_scale.py [--boxes 8] [--repeat K] [--stages nonenv|full]

For each fleet size n (1, 2, 4, ... up to --boxes) it boots n fresh P40 boxes, times the fresh
converge, then K interleaved rounds of the floor (`fact server.Hostname`) and the no-op re-run
on the same n boxes, then stops them. Stages: "nonenv" (default: base, CUDA, data, training
through bench/deploy_without_env.py; each box gets the small venv the data stage needs,
installed offline before the clock starts) because building verl's env on 15 boxes does not
fit in ten minutes on 2 cores; "full" runs deploy/env.py then deploy/full.py (timed together).
Target: the no-op re-run on 8 boxes <= 1.5x the one on 1 box.
Needs root (lab in a box). Writes bench/results/fleet_scale.json.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Pipeline, floor_args, interleave, log, render_table, run_pyinfra, summary, write_result  # noqa: E402
from tests.lab import BoxSpec, Lab  # noqa: E402

TARGET = 1.5


def sizes_up_to(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def print_profile(path, top: int = 30) -> None:
    import pstats
    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(top)


def one_size(pipe: Pipeline, n: int, repeat: int, profile: bool = False) -> dict:
    lab = pipe.lab
    hosts = [f"fleet{n}x{i + 1}" for i in range(n)]
    lab.boot([BoxSpec(h, gpu="p40") for h in hosts])
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(pipe.prepare_box, hosts))
        fresh = 0.0
        if pipe.stages == "full":
            run = run_pyinfra(lab, ["deploy/env.py"], pipe.data, hosts, tag=f"fresh-env-{n}", timeout=3600)
            run.result.assert_ok()
            fresh += run.seconds
        run = run_pyinfra(lab, [pipe.deploy_file], pipe.data, hosts, tag=f"fresh-{n}", timeout=3600)
        run.result.assert_ok()
        fresh += run.seconds
        fresh_changed = run.result.changed
        changed = []

        def floor():
            r = run_pyinfra(lab, floor_args(), pipe.data, hosts, tag=f"floor-{n}")
            r.result.assert_ok()
            return {"seconds": r.seconds}

        def noop():
            r = run_pyinfra(lab, [pipe.deploy_file], pipe.data, hosts, tag=f"noop-{n}")
            r.result.assert_ok()
            changed.append(r.result.changed)
            return {"seconds": r.seconds}

        times = interleave({"floor": floor, "noop": noop}, repeat)
        # one more no-op with every remote command timed (bench/counted_pyinfra.py): how long the
        # boxes took to answer, per host, when n of them share this machine's cores
        counted = run_pyinfra(lab, [pipe.deploy_file], pipe.data, hosts, tag=f"noop-counted-{n}", count=True)
        counted.result.assert_ok()
        per_host = [c["command_seconds"] for c in counted.commands.values()]
        commands = max(c["commands"] for c in counted.commands.values())
        log(f"{n} boxes: counted no-op {counted.seconds:.2f}s, {commands} commands per host, their time per host "
            f"median {summary(per_host)['median']:.3f}s")
        if profile:
            prof = lab.dir / f"noop-{n}.prof"
            r = run_pyinfra(lab, [pipe.deploy_file], pipe.data, hosts, tag=f"noop-profiled-{n}", profile=prof)
            r.result.assert_ok()
            log(f"{n} boxes: one more no-op under cProfile: {r.seconds:.2f}s (controller CPU, by own time):")
            print_profile(prof)
        log(f"{n} boxes: fresh {fresh:.1f}s, no-op {times['noop']}, floor {times['floor']}, changed {changed}")
        return {"boxes": n, "fresh_s": fresh, "fresh_changed": fresh_changed, "samples": times,
                "commands_per_host": commands, "command_seconds_per_host": summary(per_host),
                "floor": summary(times["floor"]), "noop": summary(times["noop"]), "noop_changed": changed}
    finally:
        for h in hosts:
            lab.stop_box(h)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--boxes", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stages", choices=("nonenv", "full"), default="nonenv")
    ap.add_argument("--mode", choices=("direct", "relay"), default="direct", help="artifact_mode")
    ap.add_argument("--sizes", help="comma-separated fleet sizes instead of 1, 2, 4 ... --boxes")
    ap.add_argument("--profile", action="store_true", help="then one more no-op per size under cProfile")
    args = ap.parse_args(argv)
    results = []
    with Lab() as lab:
        pipe = Pipeline(lab, args.stages)
        # direct mode: each box fetches for itself. In relay mode the data stage's controller
        # download (verl_lab_box/hf_snapshot.py) blocks the pyinfra process in flock() when two hosts
        # fetch the same snapshot at once, so a fresh relay converge of n > 1 boxes hangs.
        pipe.data["artifact_mode"] = args.mode
        try:
            sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else sizes_up_to(args.boxes)
            for n in sizes:
                results.append(one_size(pipe, n, args.repeat, args.profile))
        finally:
            pipe.close()
    one = results[0]
    rows = []
    for r in results:
        rows.append([r["boxes"], r["fresh_s"], r["fresh_s"] / one["fresh_s"], r["floor"]["median"],
                     r["noop"]["median"], r["noop"]["median"] / one["noop"]["median"],
                     r["noop"]["median"] / r["floor"]["median"], max(r["noop_changed"]), r["commands_per_host"],
                     r["command_seconds_per_host"]["median"]])
    print(f"\nFleet scale, {pipe.deploy_file} ({args.mode} mode), {args.repeat} interleaved rounds per size "
          "(seconds, medians)")
    print(render_table(["boxes", "fresh", "x 1 box", "floor", "no-op", "x 1 box", "x floor", "changed",
                        "cmds/host", "cmd s/host"], rows))
    last = results[-1]
    x = last["noop"]["median"] / one["noop"]["median"]
    ok = x <= TARGET and all(max(r["noop_changed"]) == 0 for r in results)
    print(f"target: no-op on {last['boxes']} boxes <= {TARGET}x 1 box -> {'MET' if ok else 'MISSED'} ({x:.2f}x)")
    path = write_result("fleet_scale", {"stages": args.stages, "artifact_mode": args.mode,
                                        "deploy_file": pipe.deploy_file,
                                        "repeat": args.repeat, "sizes": results, "noop_x_one": x,
                                        "target": TARGET, "met": ok})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
