"""verl's checkpoint saves on a box: what is under the checkpoint folder, the free disk there,
and whether a run's saves and its export still fit.

verl 0.5.0's trainer (``verl/trainer/ppo/ray_trainer.py`` ``_save_checkpoint``) writes a save as
``<checkpoint dir>/global_step_<N>/{actor,critic}/`` (critic on PPO only) and ``data.pt``, then
``latest_checkpointed_iteration.txt`` (the tracker: the last whole save). Its checkpoint manager
(``verl/utils/checkpoint/fsdp_checkpoint_manager.py`` ``save_checkpoint``) removes the oldest saves
*before* writing a new one once ``max_ckpt_to_keep`` are on disk, so at most that many are there
at any time, the one being written among them. With the project's patch
``files/patches/verl-0.5.0/0006-checkpoint-retention-across-restarts-and-nodes.diff`` a restarted
run counts the saves earlier processes made (it removes them in turn) and every node prunes its
own disk. Each removal takes ``global_step_<N>/<role>``: the step folder stays with its ``data.pt``
(the dataloader's state, a few KiB), and with the export made from that save (``hf/``,
``hf.proof.json``, ``hf.gsm8k.json``: verl_lab_box/export.py), which ``prune_exports`` removes once
the save it was made from is gone (the export program before it makes one, the launcher before it
starts verl). ``step_lock`` is the one lock per step folder that the export, its score and the
pruning take (``flock``: the kernel releases it when its holder dies).

Used in four places, one code: the train stage's fact runs ``fact_command()`` on the box and
``parse_fact_output`` on the controller (``tasks.facts.disk.CheckpointDisk``); the training stage
ships this file beside the launcher as ``verl_lab_checkpoints.py`` for the preflight's disk
check (``scan`` + ``disk_need``); the GPU harness reads what a run left (``retained_steps``, and
``step_bytes`` against ``tasks.checkpoints.predicted_save_bytes`` of the run's plan.json); the
export and score programs (``step_lock``, ``prune_exports``, loaded from beside them). Standard
library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import stat

TRACKER = "latest_checkpointed_iteration.txt"
STEP_RE = re.compile(r"^global_step_(\d+)$")
ROLES = ("actor", "critic")
# What the need adds to the prediction: 5% (the prediction's measured target is 10%; its terms are
# counts of tensor bytes, the rest is metadata) and 512 MiB (logs, the filesystem's own blocks).
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 512 * 2 ** 20
FREE_TAG, TRACKER_TAG, SAVE_TAG, EXPORT_TAG = "@@free", "@@tracker", "@@save", "@@export"
# What an export of a save leaves in its step folder (verl_lab_box/export.py, gsm8k_score.py).
EXPORT_FILES = ("hf", ".hf.partial", "hf.proof.json", "hf.gsm8k.json")
LOCK = ".export.lock"


def nearest_existing(path: str) -> str:
    """``path`` or its nearest existing parent (where a folder not made yet would be)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    return p


def tree_bytes(path: str) -> int:
    """Disk blocks under ``path`` (as ``du -sk`` counts them, in bytes): what removing it frees."""
    total = 0
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    try:
        total += os.lstat(path).st_blocks * 512
    except OSError:
        pass
    return total


def read_small(path: str, limit: int = 1 << 20) -> str | None:
    """The text of the regular file ``path`` (its first ``limit`` bytes), or None: missing, a link, a FIFO,
    a device, a folder. The checkpoint folder is the train user's, and this runs also under root's facts (the
    launcher's ``--check`` as that user, for deploy/status.py and the doctor): a FIFO in a file's place must
    not hold them, a link must not lead elsewhere."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit).decode(errors="replace")
    finally:
        os.close(fd)


def read_tracker(text: str) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def scan(checkpoint_dir: str) -> dict:
    """What is under ``checkpoint_dir`` now: ``{"free": {"path", "free_bytes"}, "tracker":
    step or None, "saves": [{"step": N, "roles": {"actor": bytes, "critic": bytes}}, ...],
    "exports": [{"step": N, "bytes": ..., "save": whether its actor save is still there}, ...]}``
    (steps ascending; a role folder only where it exists, whole or cut short; an export's bytes are
    its ``EXPORT_FILES``)."""
    where = nearest_existing(checkpoint_dir)
    st = os.statvfs(where)
    found = {"free": {"path": where, "free_bytes": st.f_bavail * st.f_frsize},
             "tracker": None, "saves": [], "exports": []}
    if not os.path.isdir(checkpoint_dir):
        return found
    found["tracker"] = read_tracker(read_small(os.path.join(checkpoint_dir, TRACKER)) or "")
    for name in os.listdir(checkpoint_dir):
        m = STEP_RE.match(name)
        if not m:
            continue
        roles = {role: tree_bytes(os.path.join(checkpoint_dir, name, role)) for role in ROLES
                 if os.path.isdir(os.path.join(checkpoint_dir, name, role))}
        if roles:
            found["saves"].append({"step": int(m.group(1)), "roles": roles})
        made = [os.path.join(checkpoint_dir, name, f) for f in EXPORT_FILES]
        if any(os.path.lexists(p) for p in made):
            found["exports"].append({"step": int(m.group(1)), "bytes": sum(tree_bytes(p) for p in made
                                                                            if os.path.lexists(p)),
                                     "save": "actor" in roles})
    found["saves"].sort(key=lambda s: s["step"])
    found["exports"].sort(key=lambda s: s["step"])
    return found


def retained_steps(checkpoint_dir: str) -> list[int]:
    """The steps whose actor save is still on disk (what retention kept), ascending."""
    return [s["step"] for s in scan(checkpoint_dir)["saves"] if "actor" in s["roles"]]


def step_bytes(checkpoint_dir: str, step: int) -> int:
    """The bytes of the files of save ``step`` (``global_step_<step>/``, every role and data.pt):
    what the plan's predicted bytes of one save (``checkpoints.save.total_bytes``) compare with."""
    root = os.path.join(checkpoint_dir, f"global_step_{step}")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


EXPORT_FORMAT = 2            # hf.proof.json's format (verl_lab_box/export.py FORMAT)


def shard_identity(actor_dir: str) -> list[dict]:
    """The files an export is made from: name, bytes and mtime of ``fsdp_config.json`` and every
    model shard (a changed checkpoint is a new export)."""
    names = sorted(n for n in os.listdir(actor_dir)
                   if n == "fsdp_config.json" or (n.startswith("model_world_size_") and n.endswith(".pt")))
    out = []
    for n in names:
        st = os.stat(os.path.join(actor_dir, n))
        out.append({"name": n, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def folder_identity(folder: str) -> list[dict]:
    """Every file under ``folder``: its path there and bytes."""
    out = []
    for root, _, files in os.walk(folder):
        for n in files:
            path = os.path.join(root, n)
            out.append({"name": os.path.relpath(path, folder), "bytes": os.path.getsize(path)})
    return sorted(out, key=lambda f: f["name"])


def proven_export(checkpoint_dir: str, step: int) -> dict | None:
    """The proof (``hf.proof.json``) of step ``step``'s export where the files still bear it out:
    proven, in this format, made from the shards there now, and ``hf/`` holding exactly the files
    it lists (names and bytes); else None. The files decide, not the JSON alone."""
    folder = os.path.join(checkpoint_dir, f"global_step_{step}")
    try:
        proof = json.loads(read_small(os.path.join(folder, "hf.proof.json")) or "")
    except ValueError:
        return None
    export, actor = os.path.join(folder, "hf"), os.path.join(folder, "actor")
    if not isinstance(proof, dict) or not proof.get("ok") or proof.get("format") != EXPORT_FORMAT:
        return None
    if not os.path.isdir(export) or not os.path.isdir(actor) or proof.get("shards") != shard_identity(actor):
        return None
    return proof if proof.get("files") == folder_identity(export) else None


class StepBusy(Exception):
    """Another process holds the step folder's lock (``step_lock(wait=False)``)."""


@contextlib.contextmanager
def step_lock(folder: str, what: str, wait: bool = True, say=print):
    """Hold the lock of one step folder (``folder/.export.lock``, ``flock``) while ``what`` runs
    there: one export, score or pruning of that step at a time. With ``wait`` a second holder waits
    (saying for whom: the first writes its pid and ``what`` into the file); without, StepBusy. The
    kernel releases the lock when the holder's process ends, however it ends; the file stays (a
    removed lock file could be locked twice: by a waiter on the old file, by a newcomer on a new one)."""
    path = os.path.join(folder, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            if not wait:
                raise StepBusy(f"{folder}: {holder} is under way") from None
            say(f"{folder}: waiting until {holder} is done (one at a time per step)")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {what}\n".encode(), 0)
        yield
    finally:
        os.close(fd)                         # releases the lock


def prune_exports(checkpoint_dir: str, say=print) -> list[dict]:
    """Remove the exports (``EXPORT_FILES``) of steps whose actor save is gone: verl's retention
    removes only ``global_step_N/<role>``. A step whose lock is held (an export or score under
    way) is left for the next time. Returns ``[{"step", "bytes"}]`` of what was removed."""
    pruned = []
    for entry in scan(checkpoint_dir)["exports"]:
        if entry["save"]:
            continue
        folder = os.path.join(checkpoint_dir, f"global_step_{entry['step']}")
        try:
            with step_lock(folder, "pruning the export of a removed save", wait=False):
                if os.path.isdir(os.path.join(folder, "actor")):
                    continue                 # saved again since the scan
                for name in EXPORT_FILES:
                    path = os.path.join(folder, name)
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)
                    elif os.path.lexists(path):
                        os.remove(path)
        except StepBusy:
            continue
        pruned.append(entry)
        say(f"pruned the export of step {entry['step']} ({gib(entry['bytes'])}): its save is gone "
            f"({folder}/actor, removed by verl's retention)")
    return pruned


# The checkpoint folder is the train user's: it can put links, FIFOs and devices anywhere in it, and swap
# a file for one between a check and a read. Root reads there only through ``as_folder_owner``: as the
# folder's owner (runuser), each file through ``read_file`` (no link followed, no FIFO waited on, 1 MiB at
# most), the whole under ``timeout``. What root gets back is then at most what that user could read anyway.
READ_S = 60            # a reading of the checkpoint folder ends by then, whatever it meets there
READ_BYTES = 1 << 20   # the most of one file a reading takes (the tracker, a proof, a score)


def read_file(path_expr: str) -> str:
    """Shell: the first ``READ_BYTES`` of the regular file at ``path_expr`` (a shell word, quoted as
    needed), refusing a link in its last component (``O_NOFOLLOW``) and never blocking on a FIFO
    (``O_NONBLOCK``); nothing for anything else."""
    return f"dd if={path_expr} iflag=nofollow,nonblock bs={READ_BYTES} count=1 status=none 2>/dev/null"


def as_folder_owner(folder: str, script: str, seconds: int = READ_S) -> str:
    """Shell that runs ``script`` (``sh -c``) as the owner of ``folder`` when root runs it, ended after
    ``seconds``; run by anyone else, as that user. The folder's own path has only root-owned parents
    (``<train_dir>``, root's, mode 750): its owner cannot swap the folder itself, only what is in it. A
    missing folder: nothing runs. A root-owned one is read as root; an owner that has no name (a
    removed user) or a failing ``runuser``: nothing is read."""
    f, n = shlex.quote(folder), int(seconds)
    return (f"if [ -d {f} ]; then o=$(stat -c %U {f}); c={shlex.quote(script)}; "
            f"if [ \"$(id -u)\" != 0 ] || [ \"$o\" = root ]; then timeout -k 5 {n} sh -c \"$c\"; "
            f"else runuser -u \"$o\" -- timeout -k 5 {n} sh -c \"$c\"; fi; fi")


def fact_command(checkpoint_dir: str) -> str:
    """Shell for ``scan``'s answer on a box without Python: ``df -P -k`` where the folder is (or
    would be), as the caller; then, as the folder's owner (``as_folder_owner``), the tracker and
    ``du -sk`` of each save's role folders and of each step's export files."""
    d = shlex.quote(checkpoint_dir)
    tracker = read_file(f'"$d/{TRACKER}"')
    listing = (
        f"d={d}; echo \"{TRACKER_TAG} $({tracker})\"; "
        "for s in \"$d\"/global_step_*; do for r in actor critic; do "
        f"[ -d \"$s/$r\" ] && echo \"{SAVE_TAG} ${{s##*/}} $r $(du -sk \"$s/$r\" 2>/dev/null | cut -f1)\"; "
        "done; if " + " || ".join(f'[ -e \"$s/{f}\" ]' for f in EXPORT_FILES) + "; then "
        f"echo \"{EXPORT_TAG} ${{s##*/}} $([ -d \"$s/actor\" ] && echo save || echo gone) $(du -sck "
        + " ".join(f'\"$s/{f}\"' for f in EXPORT_FILES) + " 2>/dev/null | tail -n 1 | cut -f1)\"; fi; done; true"
    )
    return (
        f"d={d}; p=$d; while [ ! -e \"$p\" ] && [ \"$p\" != / ]; do p=$(dirname \"$p\"); done; "
        f"echo \"{FREE_TAG} $p\"; df -P -k \"$p\" 2>&1; " + as_folder_owner(checkpoint_dir, listing) + "; true"
    )


def parse_fact_output(text: str) -> dict | None:
    """``fact_command``'s output as ``scan`` answers; None when df gave no usable row."""
    free, tracker, saves, exports = None, None, {}, []
    where = None
    for line in text.splitlines():
        if line.startswith(FREE_TAG + " "):
            where = line[len(FREE_TAG) + 1:].strip()
        elif line.startswith(TRACKER_TAG):
            tracker = read_tracker(line[len(TRACKER_TAG):])
        elif line.startswith(SAVE_TAG + " "):
            cells = line.split()
            m = STEP_RE.match(cells[1]) if len(cells) == 4 else None
            if m and cells[2] in ROLES and cells[3].isdigit():
                saves.setdefault(int(m.group(1)), {})[cells[2]] = int(cells[3]) * 1024
        elif line.startswith(EXPORT_TAG + " "):
            cells = line.split()
            m = STEP_RE.match(cells[1]) if len(cells) == 4 else None
            if m and cells[2] in ("save", "gone") and cells[3].isdigit():
                exports.append({"step": int(m.group(1)), "bytes": int(cells[3]) * 1024, "save": cells[2] == "save"})
        elif free is None:
            cells = line.split()
            if len(cells) >= 6 and all(c.isdigit() for c in cells[1:4]):
                free = int(cells[3]) * 1024
    if free is None:
        return None
    return {"free": {"path": where, "free_bytes": free}, "tracker": tracker,
            "saves": [{"step": step, "roles": roles} for step, roles in sorted(saves.items())],
            "exports": sorted(exports, key=lambda e: e["step"])}


def next_save_step(resume_step: int, every: int, last_step: int | None = None) -> int:
    """The first step a run resumed after ``resume_step`` saves at (verl saves every ``every``
    steps and at the last one)."""
    step = (resume_step // every + 1) * every
    return min(step, last_step) if last_step and last_step > resume_step else step


def overrides_dict(overrides) -> dict:
    """Hydra ``KEY=VALUE`` overrides as a dict, the last of a key winning (``+``/``++`` dropped)."""
    out = {}
    for o in overrides:
        key, sep, value = str(o).lstrip("+").partition("=")
        if sep:
            out[key] = value
    return out


def planned_last_step(overrides, train_rows: int | None) -> int | None:
    """The last step a run with these overrides trains, as verl 0.5.0 counts it
    (``ray_trainer.py``: ``trainer.total_training_steps`` when set, else ``len(train_dataloader) *
    trainer.total_epochs``, the dataloader dropping the last partial batch of
    ``data.gen_batch_size`` or ``data.train_batch_size``); ``train_rows``: the train split's rows
    (the data stage's marker). With ``filter_overlong_prompts`` verl may drop rows, so the epochs'
    count is an upper bound: a run past it is past its end. None where neither is known."""
    o = overrides_dict(overrides)

    def number(key):
        value = o.get(key, "")
        return int(value) if value.isdigit() else None

    steps = number("trainer.total_training_steps")
    batch = number("data.gen_batch_size") or number("data.train_batch_size")
    epochs = number("trainer.total_epochs")
    by_epochs = (train_rows // batch) * epochs if train_rows and batch and epochs is not None else None
    if steps is not None and by_epochs is not None:
        return min(steps, by_epochs)
    return steps if steps is not None else by_epochs


def disk_need(save_bytes: int, max_saves: int, export_bytes: int, every: int, found: dict,
              saves_in_run: int | None = None, last_step: int | None = None) -> dict:
    """The free bytes a run still needs under the checkpoint folder, and why.

    ``save_bytes``: one save on this box (``max_saves``: verl's max_*_ckpt_to_keep; each save
    written replaces the oldest of them); ``export_bytes``: the Hugging Face folder made from the
    last save, on the same disk; ``found``: ``scan``'s answer. Saves already there count as
    space to reuse only where verl removes or overwrites them: those before the run's next save
    step (the patched verl adopts them and removes the oldest first), and the one at that step
    (written over); so do exports whose save is gone (the launcher prunes them before it starts
    verl). Exports of saves still there stay (they are not in the free bytes). The peak is taken over the run's saves: the newest adopted ones that stay
    beside the new ones, then only new ones."""
    resume = found.get("tracker") or 0
    nxt = next_save_step(resume, every, last_step)
    sizes = {s["step"]: sum(s["roles"].values()) for s in found.get("saves", [])}
    adopted = [sizes[s] for s in sorted(sizes) if s < nxt]
    overwritten = sizes.get(nxt, 0)
    staying = sum(b for s, b in sizes.items() if s > nxt)
    new = max(1, min(max_saves, saves_in_run or max_saves))
    newest = adopted[::-1]
    peak = max(sum(newest[:max(0, max_saves - j)]) + j * save_bytes for j in range(1, new + 1))
    # exports whose save is gone are pruned before verl starts (prune_exports); the others stay
    orphans = sum(e["bytes"] for e in found.get("exports", []) if not e["save"])
    kept_exports = sum(e["bytes"] for e in found.get("exports", []) if e["save"])
    reusable = sum(adopted) + overwritten + orphans
    wanted = int((peak + export_bytes) * (1 + MARGIN_FRACTION)) + MARGIN_BYTES
    need = max(0, wanted - reusable)
    free = found["free"]["free_bytes"]
    return {"need_bytes": need, "free_bytes": free, "fits": free >= need, "peak_saves_bytes": peak,
            "new_saves": new, "save_bytes": save_bytes, "export_bytes": export_bytes, "reusable_bytes": reusable,
            "pruned_exports_bytes": orphans, "kept_exports_bytes": kept_exports,
            "staying_bytes": staying, "next_save_step": nxt, "path": found["free"]["path"]}


def gib(n: int) -> str:
    """Bytes as GiB (one decimal), or MiB below 1 GiB."""
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def need_words(need: dict, checkpoint_dir: str, keep: int, setting: str = "checkpoints.keep") -> str:
    """The numbers and the fix, for a disk that is short (the stage's and the preflight's words)."""
    where = "" if need["path"] == checkpoint_dir else f" (measured at {need['path']}, where it will be made)"
    made = (f"({keep} kept whole + 1 being written)" if need["new_saves"] == keep + 1
            else f"(all the {need['new_saves']} this run makes)")
    reuse = (f"; {gib(need['reusable_bytes'])} of earlier saves and exports there count as free (verl removes or "
             f"overwrites the saves, exports of removed saves are pruned)" if need["reusable_bytes"] else "")
    if need.get("kept_exports_bytes"):
        reuse += (f"; exports of kept saves hold {gib(need['kept_exports_bytes'])} (removed with their save, or by "
                  "hand: global_step_N/hf)")
    stay = (f"; {gib(need['staying_bytes'])} of saves past step {need['next_save_step']} stay"
            if need["staying_bytes"] else "")
    fewer = (f", or set {setting} lower (it is {keep}; each kept save is {gib(need['save_bytes'])})" if keep > 1
             else f" ({setting} is 1 already: the fewest that keeps a whole save while the next is written)")
    return (f"{checkpoint_dir} has {gib(need['free_bytes'])} free{where}, this run needs {gib(need['need_bytes'])} "
            f"there: {need['new_saves']} saves of {gib(need['save_bytes'])} {made} + the export "
            f"{gib(need['export_bytes'])} + {int(MARGIN_FRACTION * 100)}% and {MARGIN_BYTES // 2 ** 20} MiB margin"
            f"{reuse}{stay}. Fix: free {gib(need['need_bytes'] - need['free_bytes'])} more there, or put lab_root "
            f"on a larger disk{fewer}")
