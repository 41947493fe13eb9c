"""Artifact relay: pushing a 1 GiB artifact to a box through tasks.artifacts.artifact_file (relay
mode) vs raw scp of the same file over the same link (same key, same port).

    python bench/artifact_relay.py [--boxes N] [--repeat K] [--size-mib M]

The cuda_runfile artifact is replaced (catalog_overrides: sha256, size) by an incompressible
M MiB file served by the lab mirror; bench/deploy_relay.py places it with artifact_file. The
controller copy is fetched by the warm-up run, so the timed runs measure the push. Per round,
interleaved, on the first box:
  scp          : `scp -i KEY -P PORT FILE root@127.0.0.1:/var/tmp/x` (OpenSSH 9.2: SFTP protocol)
  relay sftp   : the deploy (pyinfra's default, paramiko SFTP); its upload alone is timed by
                 bench/counted_pyinfra.py around Host.put_file
  relay sftp-gcm: the same with AES-GCM (ssh_paramiko_connect_kwargs disabled_algorithms)
  relay scp    : the same with ssh_file_transfer_protocol = "scp" (pyinfra's own scp client)
The box file is removed between runs so every run pushes. Throughput = size / upload time.
Target: relay >= 0.7x raw scp. Then, on all N boxes with an empty controller cache: the mirror
must send the artifact exactly once (lab.mirror.served(path) == size).
Needs root (lab in a box). Writes bench/results/artifact_relay.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.download import make_file  # noqa: E402
from bench.harness import interleave, log, render_table, run_pyinfra, summary, write_result  # noqa: E402
from tasks.catalog import default_catalog  # noqa: E402
from tests.lab import BoxSpec, Lab  # noqa: E402

TARGET = 0.7
DEPLOY = "bench/deploy_relay.py"
# What pyinfra offers for the push (host data only; tasks/artifacts.py yields a FileUploadCommand
# and the connector picks the transfer): paramiko SFTP (default: aes128-ctr + hmac-sha2-256), the
# same with AES-GCM (no separate MAC pass), pyinfra's own scp client (16 KiB writes).
CTR_CBC = ["aes128-ctr", "aes192-ctr", "aes256-ctr", "aes128-cbc", "aes192-cbc", "aes256-cbc", "3des-cbc"]
VARIANTS = {
    "sftp": {},
    "sftp-gcm": {"ssh_paramiko_connect_kwargs": {"disabled_algorithms": {"ciphers": CTR_CBC}}},
    "scp": {"ssh_file_transfer_protocol": "scp"},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--boxes", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--arms", default="sftp,sftp-gcm,scp", help=f"relay variants to time, of {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    size = args.size_mib << 20
    art = default_catalog().artifact("cuda_runfile")
    hosts = [f"relay{i + 1}" for i in range(max(1, args.boxes))]
    first = hosts[0]
    protocols = [p for p in args.arms.split(",") if p]
    unknown = set(protocols) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}; use {', '.join(VARIANTS)}")
    with Lab() as lab:
        lab.boot([BoxSpec(h, gpu=None) for h in hosts])
        rel = f"{art.source}/{art.path}"
        log(f"writing a {args.size_mib} MiB stand-in for {art.name} at {rel}")
        sha = make_file(lab.mirror.path(rel), size)
        data = {"catalog_overrides": {"cuda_runfile": {"sha256": sha, "size": size}}, "artifact_mode": "relay"}
        box = lab.box(first)
        dest = f"/opt/verl-lab/cache/{art.name}/{art.filename}"

        def clear_box(name=first):
            lab.box(name).ssh(f"rm -f {dest} {dest}.sha256 {dest}.part /var/tmp/scp.bin; sync", timeout=120)

        warm = run_pyinfra(lab, [DEPLOY], data, [first], tag="relay-warm")
        warm.result.assert_ok()
        served_warm = lab.mirror.served("/" + rel)
        changed_noop = run_pyinfra(lab, [DEPLOY], data, [first], tag="relay-noop").result.changed

        def scp():
            clear_box()
            cmd = ["scp", "-q", "-F", "/dev/null", "-i", str(lab.key), "-o", "IdentitiesOnly=yes",
                   "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={lab.known_hosts}",
                   "-o", "StrictHostKeyChecking=yes", "-P", str(box.port),
                   str(lab.mirror.path(rel)), "root@127.0.0.1:/var/tmp/scp.bin"]
            t = time.monotonic()
            subprocess.run(cmd, check=True)
            return {"seconds": time.monotonic() - t}

        whole: dict[str, list[float]] = {p: [] for p in protocols}
        verify: dict[str, list[float]] = {p: [] for p in protocols}

        def relay(protocol):
            def arm():
                clear_box()
                run = run_pyinfra(lab, [DEPLOY], {**data, **VARIANTS[protocol]}, [first],
                                  count=True, tag=f"relay-{protocol}")
                run.result.assert_ok()
                assert run.result.changed == 1, run.result
                whole[protocol].append(run.seconds)
                verify[protocol].append(sum(r["seconds"] for r in run.log.commands[first] if r["kind"] == "op"))
                return {"seconds": run.commands[first]["upload_seconds"]}
            return arm

        arms = {"scp": scp, **{f"relay {p}": relay(p) for p in protocols}}
        times = interleave(arms, args.repeat)
        med = {k: summary(v) for k, v in times.items()}
        mib_s = {k: args.size_mib / v["median"] for k, v in med.items()}
        verified = box.ssh(f"cat {dest}.sha256").stdout.split()[0] == sha

        # N boxes, empty controller cache: the artifact leaves the mirror once
        for h in hosts:
            clear_box(h)
        lab.mirror.reset_counters()
        fresh_cache = str(lab.dir / "controller-cache-fanout")
        t = time.monotonic()
        fan = run_pyinfra(lab, [DEPLOY], {**data, "controller_cache": fresh_cache}, hosts, tag="relay-fanout")
        fan_s = time.monotonic() - t
        fan.result.assert_ok()
        served = lab.mirror.served("/" + rel)
        gets = [r for r in lab.mirror.requests if r.path == "/" + rel and r.method == "GET"]
        on_boxes = {h: lab.box(h).ssh(f"cat {dest}.sha256").stdout.split()[0] == sha for h in hosts}

    best = max((k for k in mib_s if k.startswith("relay")), key=lambda k: mib_s[k])
    x = {k: mib_s[k] / mib_s["scp"] for k in mib_s}
    print(f"\nPush of a {args.size_mib} MiB artifact to one box over ssh on 127.0.0.1, {args.repeat} interleaved rounds")
    rows = [[k, med[k]["median"], med[k]["min"], med[k]["max"], mib_s[k], x[k]] for k in med]
    print(render_table(["transfer", "median s", "min", "max", "MiB/s", "x scp"], rows))
    for p in protocols:
        print(f"  relay {p}: box-side commands (mkdir, sha256 check, rename) median "
              f"{summary(verify[p])['median']:.2f}s; whole deploy (pyinfra start, connect, facts, push, "
              f"check) median {summary(whole[p])['median']:.2f}s")
    print(f"target: relay >= {TARGET}x scp -> default (sftp) {x.get('relay sftp', 0):.2f}x "
          f"{'MET' if x.get('relay sftp', 0) >= TARGET else 'MISSED'}; best ({best}) {x[best]:.2f}x")
    print(f"no-op re-run of the relay deploy: changed {changed_noop}")
    print(f"\nFan-out: {len(hosts)} boxes, empty controller cache: mirror sent {served} bytes "
          f"({served / size:.2f}x the artifact) in {len(gets)} GET(s); verified on every box: "
          f"{all(on_boxes.values())}; {fan_s:.1f}s")
    once = served == size and len(gets) == 1 and all(on_boxes.values())
    path = write_result("artifact_relay", {
        "size_bytes": size, "repeat": args.repeat, "boxes": len(hosts), "samples": times, "summary": med,
        "mib_per_s": mib_s, "x_scp": x, "whole_deploy_s": whole, "box_commands_s": verify, "variants": VARIANTS, "target": TARGET,
        "met_default": x.get("relay sftp", 0) >= TARGET, "warm_served_bytes": served_warm,
        "noop_changed": changed_noop, "verified": verified,
        "fanout": {"boxes": len(hosts), "served_bytes": served, "gets": len(gets), "seconds": fan_s,
                   "verified": on_boxes, "downloaded_once": once}})
    print(f"\nwrote {path}")
    return 0 if once and verified else 1


if __name__ == "__main__":
    sys.exit(main())
