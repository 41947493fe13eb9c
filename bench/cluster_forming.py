"""Seconds for 1, 2, 4 and 8 lab boxes to form a Ray cluster (issue 17).

    python bench/cluster_forming.py [--boxes 8] [--out docs/cluster-forming.png]

Boots --boxes lab boxes (stand-in T4s) once, puts the real Ray 2.46.0 in a venv at the env
prefix of the first box (tests/e2e/test_cluster.py's install_ray) and copies it to the others
(before any clock starts), then for each size n (1, 2, 4, ...): deploy/cluster.py on the first
n boxes (a new cluster each time: its own name and port; addresses 127.0.0.10+i) and the wait
until the head sees n nodes alive; then the n Ray units are stopped and disabled. Two numbers
per size: the deploy (pyinfra, prepare + execute) and the deploy plus the joins. All boxes share
this machine's CPUs (2 cores here): more boxes also means more Ray processes starting at once
on the same cores, unlike a real lab. Needs root (lab in a box). Writes
bench/results/cluster_forming.json and the figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.test_cluster import ENV, NODES, RAY_WHEELS, install_ray  # noqa: E402
from tests.lab import BoxSpec, Lab  # noqa: E402
from tests.lab.box import free_port  # noqa: E402


def alive(lab, head: str, address: str) -> int:
    code = NODES.format(addr=address).replace("'127.0.0.2'", repr(address.split(":")[0]))
    res = lab.box(head).ssh(f"cd /opt/verl-lab/home && {ENV}/bin/python -c \"{code}\"", user="verl", check=False,
                            timeout=120)
    try:
        return len(json.loads(res.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError):
        return 0


def one_size(lab, names: list[str], n: int) -> dict:
    hosts, port = names[:n], free_port()
    head_ip = "127.0.0.10"
    data = {"cluster": {"name": f"bench{n}", "head": hosts[0], "port": port}}
    per_host = {h: {"cluster_address": f"127.0.0.{10 + i}"} for i, h in enumerate(hosts)}
    started = time.monotonic()
    res = lab.deploy("deploy/cluster.py", data=data, per_host=per_host, hosts=hosts, timeout=900)
    deployed = time.monotonic() - started
    res.assert_ok()
    while alive(lab, hosts[0], f"{head_ip}:{port}") < n:
        if time.monotonic() - started > 600:
            raise RuntimeError(f"{n} boxes: the cluster did not form in 600 s")
        time.sleep(1)
    formed = time.monotonic() - started
    for h in hosts:
        lab.box(h).ssh("systemctl disable --now verl-lab-ray.service")
    print(f"{n} boxes: deploy {deployed:.1f} s, all joined {formed:.1f} s", flush=True)
    return {"boxes": n, "deploy_s": round(deployed, 1), "formed_s": round(formed, 1)}


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["boxes"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(x, [r["formed_s"] for r in rows], "o-", label="deploy/cluster.py + every node joined")
    ax.plot(x, [r["deploy_s"] for r in rows], "s--", label="deploy/cluster.py (pyinfra)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("boxes in the Ray cluster (lab in a box, one 2-core machine)")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.set_title("Forming a Ray cluster with verl-lab")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--boxes", type=int, default=8)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "cluster-forming.png")
    args = ap.parse_args(argv)
    from tests.fixtures.standins.env import wheelhouse

    sizes = [n for n in (1, 2, 4, 8, 16) if n <= args.boxes]
    names = [f"ray{i + 1}" for i in range(sizes[-1])]
    with Lab() as lab:
        lab.boot([BoxSpec(n, gpu="t4") for n in names])
        install_ray(lab.box(names[0]), [w for w in wheelhouse().glob("*.whl") if w.name.split("-")[0].lower()
                                        in RAY_WHEELS])
        src = lab.box(names[0]).root / ENV.lstrip("/")
        for n in names[1:]:
            dest = lab.box(n).root / ENV.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["cp", "-a", str(src), str(dest)], check=True)
        rows = [one_size(lab, names, n) for n in sizes]
    result = {"bench": "cluster_forming", "ray": "2.46.0", "machine_cpus": __import__("os").cpu_count(),
              "rows": rows}
    (REPO / "bench" / "results" / "cluster_forming.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.out)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
