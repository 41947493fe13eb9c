"""The burn-in's GPU profiles (docs/burnin.md): the product's own burn-in (``train-launcher --burnin``) of four cards'
plans and one mutated run, side by side on the device's one H200, each capped as its card.

Runs here (it needs the planning code): ``render`` writes what deploy/train.py and deploy/burnin.py would put in a box's
``<lab_root>/train`` (plan.json, the launcher and its parts, the burn-in's programs, its probe folder and
``burnin-plan.json`` with the profile's prompts a step), plus ``profile.json`` (kind ``burnin``, the cap, the verl tree)
into ``.gpu/profiles/<name>/``. bench/gpu/run_burnin.sh runs them on the device (bench/gpu/run_profile.py: the
launcher's ``--burnin --no-preflight``: the device's H200 is not the plan's card), bench/gpu/burnin_results.py reads
them back.

    .venv/bin/python bench/gpu/burnin_profiles.py render [--only NAME,...]

Each burn-in keeps its plan's micro-batches, HF chunk, lengths, offloads, dtype, rollout engine (the HF rollout where
the plan would take vLLM, which cannot run on the device) and LoRA, with fewer prompts a step (``PROMPTS``) so that
five of them fit one device call: a step then holds less than a whole HF chunk, so the rollout phase peaks under the
plan's figure (the others run at their planned shapes). The mutated run takes the payload's verl tree with a test-only
patch (tests/fixtures/burnin/mutations/: bench/gpu/payload.py builds ``current-<mutation>``) and must fail with the
doctor's reason.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from ppo_profiles import LAB_BASE, OUT_DEFAULT, Profile, profile_layout  # noqa: E402

PROMPTS = {"n1": 64, "n4": 16}      # prompts a step: 64 sequences either way (PPO's n=1, GRPO's n=4)


@dataclass(frozen=True)
class Burnin:
    profile: Profile
    mutation: str = ""               # a tests/fixtures/burnin/mutations/<name>.diff applied to the verl tree
    expect: str = "passed"           # what the read-back checks: passed, or the failed check's id

    @property
    def verl_tree(self) -> str:
        return f"current-{self.mutation}" if self.mutation else "current"


BURNINS = {b.profile.name: b for b in (
    Burnin(Profile("p40-burnin", "Tesla P40", "6.1", 24576,
                   stands_for="Tesla P40 (24 GiB): its PPO plan (fp32, HF rollout, the critic), burned in")),
    Burnin(Profile("gtx1080-burnin", "NVIDIA GeForce GTX 1080", "6.1", 8192, finetune="full",
                   stands_for="GTX 1080 (8 GiB): its full fine-tune on the CPU-offload rung (FSDP2 CPUOffloadPolicy, "
                              "fp32, HF rollout), burned in")),
    Burnin(Profile("rtx3060-burnin", "NVIDIA GeForce RTX 3060", "8.6", 12288, finetune="full", rollout_engine="hf",
                   stands_for="RTX 3060 (12 GiB): its bf16 full fine-tune; HF rollout instead of the plan's vLLM, "
                              "burned in")),
    Burnin(Profile("gtx1080-lora-burnin", "NVIDIA GeForce GTX 1080", "6.1", 8192,
                   stands_for="GTX 1080 (8 GiB): its default plan, LoRA (grpo-lora, fp32, HF rollout, patch 0013's "
                              "merged rollout), burned in")),
    Burnin(Profile("rtx3060-burnin-sign-flipped", "NVIDIA GeForce RTX 3060", "8.6", 12288, finetune="full",
                   rollout_engine="hf",
                   stands_for="rtx3060-burnin with the advantage's sign flipped (a test-only patch of the verl tree): "
                              "must fail, reward-fell"),
           mutation="advantage-sign-flipped", expect="reward-fell"),
)}


def render(names: list[str], out_root: Path = OUT_DEFAULT, lab_base: str = LAB_BASE) -> None:
    from tasks.burnin import BurninSpec, burnin_plan
    from tasks.burnin.stage import burnin_wanted

    for name in names:
        b = BURNINS[name]
        out = out_root / name
        shutil.rmtree(out, ignore_errors=True)
        train = out / "train"
        root = f"{lab_base}/{name}"
        layout, _ = profile_layout(b.profile, REPO, root)
        from tasks.train import training_wanted

        plan = layout.plan
        prompts = PROMPTS["n1" if plan.workload.rollout_n == 1 else "n4"]
        bp = burnin_plan(plan, layout.train_dir, name, BurninSpec(prompts=prompts))
        for want in [*training_wanted(layout), *burnin_wanted(layout, json.dumps(bp, indent=2) + "\n")]:
            if want.content is None or not want.path.startswith(layout.train_dir + "/"):
                continue                     # folders (the launcher makes its own), the units under /etc/systemd
            path = train / want.path[len(layout.train_dir) + 1:]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(want.content)
            path.chmod(0o755 if want.path == layout.launcher else 0o644)
        d = plan.to_dict()
        record = {**asdict(b.profile), "kind": "burnin", "cap_mib": b.profile.cap_mib, "lab_root": root,
                  "verl_tree": b.verl_tree, "mutation": b.mutation, "expect": b.expect, "env": {},
                  "extra_overrides": [], "probe_profile": "",
                  "plan": {"model_dir": Path(layout.settings.model_dir).name, "rung": d["rung"],
                           "predicted_peak_mib": d["predicted_peak_mib"], "breakdown": d["breakdown"],
                           "micro_batches": d["micro_batches"], "rollout": d["rollout"], "lora": d["lora"]},
                  "burnin": {"prompts": prompts, "steps": bp["steps"], "lr": bp["lr"]}}
        (out / "profile.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"{name:28} {d['rung']:17} {d['train_dtype']:5} cap {b.profile.cap_mib} MiB  predicted "
              f"{d['predicted_peak_mib']} MiB  prompts {prompts}  lr {bp['lr']['burnin']}  tree {b.verl_tree}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("--only", default=",".join(BURNINS))
    r.add_argument("--out", type=Path, default=OUT_DEFAULT)
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in BURNINS]
    if unknown:
        ap.error(f"unknown burn-in profile(s) {', '.join(unknown)}; known: {', '.join(BURNINS)}")
    render(names, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
