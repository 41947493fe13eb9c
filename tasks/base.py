"""Stage 0: the box-side layout every later stage writes into, and the training user; and the
host's target (tasks/target.py: its GPU, and the host compiler nvcc 11.8 and Apex's build use),
read in the same command, returned to the stages; gcc-11 installed here where the box needs it."""

from __future__ import annotations

import sys
from dataclasses import replace

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.facts.server import LinuxDistribution
from pyinfra.operations import apt, server

from tasks.facts.bundle import ask
from tasks.facts.files import PasswdEntry, PathStates, RootOnlyChain
from tasks.facts.gpu import NvidiaGpus
from tasks.facts.nvidia import CudaHostCompiler
from tasks.failure import fail_host
from tasks.placed import missing_under_shared, place, root_dir_command, root_only_problem, wanted_dir
from tasks.plan import GpuTarget, rollout_refusal
from tasks.settings import LabSettings, SettingsError
from tasks.target import HOST_COMPILER_PACKAGES, HostTarget, decide_compiler, decide_gpu

SHELL = "/usr/sbin/nologin"


@deploy("verl-lab base layout")
def base_layout(settings: LabSettings, trains: bool = True) -> HostTarget:
    """Create lab_root with its markers/ and cache/ folders, and the unprivileged training user;
    return the host's target (GPU, host compiler) for the stages after it.

    One command decides (the user's passwd entry, the folders' modes, the GPUs and driver, the
    distro and its gcc): a re-run on a box that is as it should be issues no operation at all.

    A workload the box's GPU cannot run (``workload.rollout = 'vllm'`` below compute capability
    7.0) fails the box before any operation; so, with ``trains`` (every deploy but the CUDA
    toolkit's alone), does a box whose training plan cannot exist (tasks/validation.py: an
    unsupported GPU, no GPU, a workload that does not fit or that verl refuses): only its failure
    is queued, and the target comes back with ``refused`` set: the deploy file queues nothing after it.
    """
    home = f"{settings.lab_root}/home"
    dirs = [wanted_dir(settings.lab_root), wanted_dir(settings.marker_dir),
            wanted_dir(settings.box_cache, mode="750")]
    work = root_work(settings)
    states, entry, gpus, distro, gcc, chains = ask(
        (PathStates, {"paths": [home] + [d.path for d in dirs]}), (PasswdEntry, {"user": settings.train_user}),
        (NvidiaGpus, {}), (LinuxDistribution, {}), (CudaHostCompiler, {}), (RootOnlyChain, {"paths": list(work.values())}))
    unsafe = [f"{key} = {path!r}: {why}" for key, path in work.items()
              if (why := root_only_problem(path, (chains or {}).get(path)))]
    if unsafe:       # before anything on this box changes: root would work where someone else can swap names
        message = (f"host {settings.host}: " + "; ".join(unsafe) + ". Fix: remove what is in the way (after a look "
                   "at it), or set the key to a folder whose every parent only root can change")
        fail_host(name="verl-lab folders root works in", stage="base", message=message)
        return replace(decide_gpu(settings, gpus), refused=message)
    compiler = decide_compiler((distro or {}).get("release_meta") or {}, gcc)
    target = replace(decide_gpu(settings, gpus), compiler=compiler)
    rollout = settings.workload["rollout"]
    refusal = target.target and rollout_refusal(rollout, target.target)
    if refusal:        # before anything on this box changes (its GPU is known only now)
        message = (f"host {settings.host}: workload.rollout = {rollout!r} (GPU from {target.source}): "
                   f"{refusal[0]}. Fix: {refusal[1]}")
        fail_host(name="workload.rollout", stage="base", message=message)
        return replace(target, refused=message)
    # a box whose GPUs no driver lists yet, with driver = "install": the driver stage reads them from
    # the PCI bus, installs the driver and stops the box there ("re-run"): its plan is made then
    awaits_driver = settings.driver == "install" and target.target is None
    problem = cannot_train(settings, target) if trains and not awaits_driver else None
    if problem:
        fail_host(name="verl-lab checks: this box cannot train (nothing was changed)", message=str(problem),
                  stage="checks")
        return replace(target, refused=str(problem))
    home_state = (states or {}).get(home)
    if (entry and entry["uid"] != 0 and entry["home"] == home and entry["shell"] == SHELL
            and home_state and home_state.get("kind") == "dir" and home_state.get("user") == settings.train_user):
        host.noop(f"training user {settings.train_user} exists (uid {entry['uid']}, home {home})")
    else:
        server.user(
            name=f"Training user {settings.train_user} (unprivileged)",
            user=settings.train_user,
            system=True,
            shell=SHELL,
            home=home,
            create_home=True,
        )
    place(dirs, states or {})
    shared = missing_under_shared((chains or {})[settings.install_tmpdir])
    if shared:      # e.g. /var/tmp/verl-lab: anyone can take the name first, so root makes it and checks
        server.shell(name=f"Directory {settings.install_tmpdir} (root's, in a folder others can write in)",
                     commands=[root_dir_command(path) for path in shared])
    if compiler.install:
        apt.update(name="apt update (for gcc-11, the newest gcc nvcc 11.8 accepts)")
        apt.packages(name=f"Host compiler for nvcc 11.8 and the Apex build: {compiler.reason}",
                     packages=list(HOST_COMPILER_PACKAGES), no_recommends=True)
    return target


def root_work(settings: LabSettings) -> dict[str, str]:
    """The folders root's stages make and work in, by their setting's name: each must be one only root
    can change (``tasks.placed.root_only_problem``), or the base stage refuses the box."""
    work = {"lab_root": settings.lab_root, "install_tmpdir": settings.install_tmpdir,
            "cuda_prefix": settings.cuda_prefix, "env_prefix": settings.env_prefix}
    if settings.env_backend == "conda":
        work["conda_prefix"] = settings.conda_prefix
    return work


def cannot_train(settings: LabSettings, target: HostTarget):
    """Why this box cannot train, as a SettingsError (None: its plan exists): the plan alone, or
    its cluster's by every member's GPU (the other members' GPU facts, asked at prepare time)."""
    from tasks.hostdata import cluster_for, member_targets
    from tasks.validation import plan_problem

    cluster = cluster_for()
    members = member_targets(cluster, settings.host, target.target) if cluster and target.target else None
    return plan_problem(settings, target.target, target.source, target.problem, members)


# ------------------------------------------------------------------ the run's checks, every host at once

class BoxProblem(SettingsError):
    """A problem only a box shows (its GPU, driver, disk): host, what, and the text with its fix."""

    def __init__(self, host_name: str, key: str, text: str):
        self.host, self.key, self.problem, self.fix = host_name, key, text, ""
        ValueError.__init__(self, f"host {host_name}: {key}: {text}")


class BoxWarning(BoxProblem):
    """What a box shows that may stop the run later but refuses nothing now (the RAM other processes hold)."""


_RUN = {"done": False, "report": None, "refused": {}, "lock": None}


def check_run() -> bool:
    """deploy/full.py's first line, on every host: one report of every problem of every host of the
    run (the inventory's values, then what each box tells: its GPU, its driver, its free disk, the
    training plan on that GPU and verl 0.5.0's own checks), before any host changes. Whether this
    host goes on.

    pyinfra prepares each host in a greenlet of its own (pyinfra_cli.util._parallel_load_hosts) after
    it connected to every host (connect_all): the first host here asks every host's facts, side by
    side, in one bundle each; the others wait for it. Who is refused (``refused_hosts``): every host
    when the inventory's values have a problem (the file is wrong: no operation is queued on any host,
    RunRefused) or when every host of the run has one; else only the boxes with a problem, and the
    other members of their Ray cluster: each queues its failure alone (``fail_host``, which changes
    nothing) and the other hosts of the run go on."""
    import gevent.lock
    if _RUN["lock"] is None:
        _RUN["lock"] = gevent.lock.Semaphore()
    with _RUN["lock"]:
        if not _RUN["done"]:
            _RUN["report"], _RUN["refused"] = run_report()
            _RUN["done"] = True
            if _RUN["report"]:     # printed once, by the host that made it
                print(_RUN["report"], file=sys.stderr, flush=True)
    from tasks.hostdata import _IN_RUN
    refused = _RUN["refused"]
    if refused and set(_IN_RUN) <= set(refused):
        # a PyinfraError: pyinfra's loader returns it from the host's greenlet and the CLI prints it
        # once, as one line (a SystemExit would escape the greenlet into gevent's hub, with a traceback)
        raise RunRefused("verl-lab: the checks before any change found the problems above; nothing was "
                         "changed on any host")
    why = refused.get(host.name)
    if why:
        from tasks.hostdata import _CACHE
        from tasks.run_summary import note, stage
        settings = _CACHE.get(host.name)
        note(gpu="?", unit="not deployed", **({"cache": str(settings.controller_cache)} if settings else {}))
        with stage("checks"):
            fail_host(name="verl-lab checks: refused (nothing on this box was changed)", message=why, stage="checks")
    return not why


class RunRefused(PyinfraError):
    """The run's checks found problems: no host of the run is changed."""


def refused_hosts(problems: list[SettingsError], in_run: list[str], clusters: dict[str, str | None],
                  inventory: bool) -> dict[str, str]:
    """Who the run's checks refuse, and why in one line (pure). ``clusters``: host -> its Ray cluster's
    name (None: it trains alone); ``inventory``: whether the inventory's values had a problem, which
    refuses every host of the run."""
    if not problems:
        return {}
    if inventory:
        return {name: "the inventory has problems (above): nothing on any host was changed" for name in in_run}
    keys: dict[str, list[str]] = {}
    for p in problems:
        keys.setdefault(p.host, []).append(p.key)
    out = {name: f"its {plural(len(keys[name]), 'problem')} above ({', '.join(dict.fromkeys(keys[name]))}); "
                 "nothing on this box was changed" for name in in_run if name in keys}
    for name in in_run:
        cluster = clusters.get(name)
        bad = sorted(m for m, c in clusters.items() if c and c == cluster and m in keys and m != name)
        if cluster and bad and name not in out:
            out[name] = (f"its Ray cluster {cluster!r} trains only when every member can, and "
                         f"{', '.join(bad)} cannot (above); nothing on this box was changed")
    return out


def run_report() -> tuple[str | None, dict[str, str]]:
    """The report of the run's checks (None: no problem) and the hosts it refuses, with why."""
    from pyinfra import state

    from tasks.hostdata import _CACHE, _IN_RUN, check_inventory, warning_report

    inventory = check_inventory(stop=False)
    hosts = [h for h in state.inventory.get_active_hosts() if h.name in _CACHE and _data_planned(_CACHE[h.name])]
    answers = ask_every_host(hosts)
    in_run = {h.name: _CACHE[h.name] for h in hosts}
    problems = inventory + box_problems(in_run, answers) + relay_problems(in_run, answers)
    problems = list({str(p): p for p in problems}.values())   # a gpu_override's plan: checked in both passes
    warnings = [p for p in problems if isinstance(p, BoxWarning)]
    problems = [p for p in problems if not isinstance(p, BoxWarning)]
    if not problems:
        return (warning_report(warnings, list(_IN_RUN)) if warnings else None), {}
    clusters = {name: (s.cluster or {}).get("name") if s else None for name, s in _CACHE.items()}
    refused = refused_hosts(problems, list(_IN_RUN), clusters, inventory=bool(inventory))
    from tasks.run_summary import record_run
    for name, s in _CACHE.items():      # deploy/status.py tells from these why a box is not installed
        mine = [str(p) for p in problems if p.host == name]
        if mine and name in _IN_RUN:
            record_run(str(s.controller_cache), name, ok=False, stage="checks", message=" | ".join(mine),
                       line=f"verl-lab: {name}: refused by the checks before any change")
    order = {name: i for i, name in enumerate(_IN_RUN)}
    problems = sorted(problems, key=lambda p: order.get(p.host, len(order)))   # stable: each host's together
    bad = list(dict.fromkeys(p.host for p in problems))
    from tasks.hostdata import report
    if set(_IN_RUN) <= set(refused):
        outcome = "nothing was changed on any host:"
    else:
        going = [name for name in _IN_RUN if name not in refused]
        outcome = (f"{plural(len(refused), 'host')} refused and left unchanged ({', '.join(sorted(refused))}), "
                   f"the other {len(going)} go on ({', '.join(going)}):")
    text = report(problems, header=(
        f"verl-lab: {plural(len(problems), 'problem')} on {plural(len(bad), 'host')} of {len(_IN_RUN)} in this run "
        f"(inventory values, then what each box told: GPU, driver, disk, RAM, the plan and its length, verl's own "
        f"checks); {outcome}"))
    return (text + ("\n" + warning_report(warnings, list(_IN_RUN)) if warnings else "")), refused


def _data_planned(settings: LabSettings) -> bool:
    """Whether the data stage's plan exists (else the inventory pass reported why: no box check)."""
    from tasks.data import data_plan
    try:
        data_plan(settings)
    except SettingsError:
        return False
    return True


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def box_facts(settings: LabSettings) -> list[tuple[type, dict]]:
    """What the run's checks read on one box, in one bundle: its GPUs and driver, the model and
    data already there and the free disk for the rest, the disk under the checkpoint folder, its RAM."""
    from tasks.data import data_plan
    from tasks.facts.data import SnapshotStamp
    from tasks.facts.disk import CheckpointDisk, FreeDisk
    from tasks.facts.endpoint import EndpointServes, api_url
    from tasks.facts.memory import HostMemory
    plan = data_plan(settings)
    facts = [(NvidiaGpus, {}), (SnapshotStamp, {"dest": plan.model_dir}), (SnapshotStamp, {"dest": plan.source_dir}),
             (FreeDisk, {"path": plan.model_dir}), (CheckpointDisk, {"path": f"{settings.train_dir}/checkpoints"}),
             (HostMemory, {})]
    if plan.mode == "direct":     # the box downloads: whether the endpoint serves it, asked from the box
        facts += [(EndpointServes, {"url": api_url(plan.endpoint, spec.repo_type, spec.repo, spec.revision),
                                    "python": settings.launcher_python, "dest": dest, "digest": spec.digest})
                  for spec, dest in ((plan.model, plan.model_dir), (plan.dataset, plan.source_dir))]
    return facts


def ask_every_host(hosts) -> dict[str, list]:
    """Every host's box facts, asked side by side (one greenlet, one command a host)."""
    import gevent
    from pyinfra import state
    from pyinfra.context import ctx_config, ctx_host

    from tasks.facts.bundle import Bundle
    from tasks.hostdata import _CACHE

    def one(h):
        facts = box_facts(_CACHE[h.name])
        with ctx_config.use(state.config.copy()), ctx_host.use(h):
            try:
                got = h.get_fact(Bundle, facts=facts)
            except Exception as exc:     # noqa: BLE001 - a box that cannot answer is a problem of that box
                return exc
        return got if isinstance(got, list) and len(got) == len(facts) else [cls().default() for cls, _ in facts]

    jobs = {h.name: gevent.spawn(one, h) for h in hosts}
    gevent.joinall(list(jobs.values()))
    return {name: job.value for name, job in jobs.items()}


def box_problems(settings: dict[str, LabSettings], answers: dict[str, list]) -> list[SettingsError]:
    """Every problem the boxes' answers show (pure: settings and answers in, problems out)."""
    from tasks.hostdata import cluster_for
    from tasks.run_bounds import fit_problems
    targets, found = {}, []
    for name, got in answers.items():
        if isinstance(got, Exception):
            found.append(BoxProblem(name, "facts", f"the box did not answer the checks' facts: {got}"))
            continue
        targets[name] = decide_gpu(settings[name], got[0])
    for name, target in targets.items():
        s, (_gpus, model_stamp, data_stamp, free, ckpt_disk, memory, *probes) = settings[name], answers[name]
        found += driver_problems(s, target)
        found += served_problems(s, (model_stamp, data_stamp), probes)
        rollout = s.workload["rollout"]
        refusal = target.target and rollout_refusal(rollout, target.target)
        if refusal:
            found.append(SettingsError(name, "workload.rollout", f"{rollout!r} (GPU from {target.source}): "
                                       f"{refusal[0].rstrip('.')}", refusal[1].rstrip(".")))
            # the rest of the plan is still checked, with the rollout this GPU runs
            s = replace(s, workload={**s.workload, "rollout": "auto"})
        found += disk_problems(s, model_stamp, data_stamp, free)
        if s.driver == "install" and target.target is None:
            continue     # the driver stage reads the GPUs from the PCI bus and installs the driver first
        cluster = cluster_for(_Named(name))
        members = None
        if cluster and target.target:
            members = {m: (targets[m].target if m in targets else None) for m in cluster.members}
        from tasks.validation import plan_problem
        problem = plan_problem(s, target.target, target.source, target.problem, members)
        if problem or target.target is None:        # no GPU target: plan_problem's problem says so
            found += [problem] if problem else []
            continue
        found += checkpoint_problems(s, target.target, target.source, members, ckpt_disk)
        found += [(BoxWarning if warning else BoxProblem)(name, key, text)      # tasks/run_bounds.py
                  for key, text, warning in fit_problems(s, target.target, members, memory)]
    return found


class _Named:
    def __init__(self, name: str):
        self.name = name


def served_problems(settings: LabSettings, stamps, probes) -> list[SettingsError]:
    """A model or dataset the endpoint does not serve, where the box still needs it: in direct mode
    from the box's own probes (tasks/facts/endpoint.py); relay mode is asked on the controller
    (``relay_problems``)."""
    from tasks.data import data_plan
    from tasks.facts.endpoint import served_problem
    if not probes:
        return []
    plan = data_plan(settings)
    found = []
    for spec, stamp, probe in zip((plan.model, plan.dataset), stamps, probes, strict=True):
        if stamp and stamp.get("digest") == spec.digest:
            continue        # already on the box: the endpoint is not asked for it again
        text = served_problem(probe, spec.label, f"catalog_overrides.{spec.artifact}", plan.endpoint_shown)
        if text:
            found.append(BoxProblem(settings.host, f"{spec.repo_type} ({spec.artifact}, direct)", text))
    return found


_LISTED: dict = {}      # (endpoint, spec digest) -> the relay check's answer, once per run


def relay_problems(settings: dict[str, LabSettings], answers: dict[str, list]) -> list[SettingsError]:
    """Relay mode: the controller downloads the model and data, so it asks the endpoint (the pinned
    revision's file list, sizes and sha256 against the catalog: ``hf_snapshot.list_remote``) for
    what a box still needs and the controller's cache does not hold, once per repo and revision."""
    from tasks.data import data_plan
    from tasks.data.stage import controller_dir, hf_token
    from verl_lab_box.hf_snapshot import SnapshotError, list_remote, stamp_matches
    found = []
    for name, got in answers.items():
        s = settings[name]
        if isinstance(got, Exception) or s.artifact_mode != "relay":
            continue
        plan = data_plan(s)
        for spec, stamp in zip((plan.model, plan.dataset), got[1:3], strict=True):
            if (stamp and stamp.get("digest") == spec.digest) or stamp_matches(controller_dir(s, spec), spec):
                continue
            key = (plan.endpoint, spec.digest)
            if key not in _LISTED:
                try:
                    list_remote(spec, plan.endpoint, hf_token(s))
                    _LISTED[key] = None
                except (SnapshotError, OSError) as exc:
                    _LISTED[key] = str(exc)
            if _LISTED[key]:
                found.append(BoxProblem(name, f"{spec.repo_type} ({spec.artifact}, relay)", _LISTED[key]))
    return found


def driver_problems(settings: LabSettings, target: HostTarget) -> list[SettingsError]:
    """The CUDA stage's driver check (driver = "check": the driver the box has must run CUDA 11.8)."""
    if settings.driver != "check":
        return []
    from tasks.cuda import check_driver, cuda_want
    want = cuda_want(settings)
    text = check_driver(target.driver, want.min_driver, want.allow_no_driver, want.cuda_release)
    return [BoxProblem(settings.host, "driver (nvidia-smi)", text)] if text else []


def disk_problems(settings: LabSettings, model_stamp, data_stamp, free) -> list[SettingsError]:
    """The data stage's disk check: room for the model and data not yet on the box."""
    from tasks.data import data_plan
    from tasks.data.stage import disk_shortfall
    plan = data_plan(settings)
    todo = [spec for spec, stamp in ((plan.model, model_stamp), (plan.dataset, data_stamp))
            if not (stamp and stamp.get("digest") == spec.digest)]
    short = disk_shortfall(todo, free if todo else None, plan.model_dir)
    return [BoxProblem(settings.host, "disk (model and data)", short)] if short else []


def checkpoint_problems(settings: LabSettings, gpu: GpuTarget, source: str, members, disk) -> list[SettingsError]:
    """The training stage's disk check: the kept checkpoint saves, the one being written, the export (``gpu``: the
    host's GPU target, from ``source``)."""
    from tasks.plan import PlanError
    from tasks.train import TrainingLayout, checkpoint_disk_short
    from tasks.validation import training_plan
    try:
        plan = training_plan(settings, gpu, members)
    except PlanError:
        return []
    short = checkpoint_disk_short(TrainingLayout(settings=settings, plan=plan, plan_source=source), disk)
    return [BoxProblem(settings.host, "disk (checkpoints)", short)] if short else []
