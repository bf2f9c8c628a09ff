"""
Checkpoints, and weights in and out.

A checkpoint is a SET: out_dir/ckpt/iter_<N>/ holds one file per (tp, pp) rank (per dp rank too
with ZeRO-1, whose optimizer state is sharded), and COMPLETE, which rank 0 writes only after every
rank has written its file (a barrier): a set without it (a kill mid-save) is never resumed from,
and the previous complete set is deleted only once the new one is complete. COMPLETE records the
run's identity (a random id drawn when the run starts, kept across resumes) and every file's
sha256; a resume checks both, so a file changed on disk or taken from another run is named.

A FULL state dict is the single-rank model's (tp = pp = 1) names and shapes: merge() builds it
from a set's shards, shard_into() slices one into a rank's model (the same slicing the model's
initialisation uses); hf.py converts Hugging Face folders to and from it.
"""

import atexit
import contextlib
import dataclasses
import errno
import glob
import hashlib
import json
import os
import secrets
import shutil
import socket

import torch
import torch.distributed as dist

from model import FAMILIES, GPT, ColumnParallelLinear, GPTConfig, RowParallelLinear

LAYOUT_KEYS = ("tp", "pp", "zero1")  # the settings a set's files are cut by
# model settings a resume may change: how the loss and the backward are computed, not what (RELIABILITY.md lists the run's)
CHANGEABLE = ("dropout", "loss_chunk", "recompute")


def claim(out_dir, resume, overwrite, rank0):
    """Refuse a new run into an out_dir that holds another run's checkpoints (unless resume, or
    overwrite, which deletes them); rank 0 holds out_dir/LOCK while it runs, so a second run into
    the same out_dir at the same time is refused (a LOCK whose process is gone is taken over)."""
    found = sets(out_dir, complete=False)
    if found and not resume and not overwrite:
        go_on = "--resume continues it, " if sets(out_dir) else "none complete (cut short), so "
        raise SystemExit(
            f"{out_dir} holds another run's checkpoints ({os.path.basename(found[-1])}): {go_on}"
            f"--overwrite starts over (deleting them), or choose another --out_dir"
        )
    if not rank0:
        return
    lock, me = os.path.join(out_dir, "LOCK"), f"{socket.gethostname()} {os.getpid()}"
    mine = f"{lock}.{os.getpid()}"
    with os_errors(out_dir, "claim the out_dir"):
        os.makedirs(out_dir, exist_ok=True)
        with open(mine, "w") as f:  # the owner written first, then linked in: never an empty LOCK
            f.write(me)
        try:
            while not _linked(mine, lock):
                try:
                    with open(lock) as f:
                        host, _, pid = f.read().partition(" ")
                except FileNotFoundError:
                    continue  # released meanwhile: try again
                except OSError:
                    host = pid = ""
                if not (host and pid.isdigit()):  # empty or unreadable: a claim cut short
                    print(f"{lock} names no owner (a claim cut short, e.g. by a full disk): taking it over")
                elif host != socket.gethostname() or _alive(int(pid)):
                    raise SystemExit(
                        f"{out_dir} is in use by another run (process {pid} on {host}): choose "
                        f"another --out_dir, or delete {lock} if that run is gone"
                    )
                with contextlib.suppress(FileNotFoundError):
                    os.remove(lock)  # its run is gone
        finally:
            os.remove(mine)
    atexit.register(_release, lock, me)
    if overwrite and not resume:
        shutil.rmtree(os.path.join(out_dir, "ckpt"), ignore_errors=True)


def _linked(src, dst):
    """Link src to dst unless dst exists (atomic)."""
    try:
        os.link(src, dst)
        return True
    except FileExistsError:
        return False


FIXES = {
    errno.ENOSPC: "the disk is full: free space on it, or choose another --out_dir",
    errno.EDQUOT: "the disk quota is used up: free space, or choose another --out_dir",
    errno.EROFS: "the file system is read-only: choose another --out_dir",
    errno.EACCES: "permission denied: choose a folder you may write, or change its permissions",
    errno.ENAMETOOLONG: "a name in the path is too long (255 bytes a component): choose a shorter one",
    errno.ENOTDIR: "a part of the path is a file, not a folder: choose another path",
}


@contextlib.contextmanager
def os_errors(path, what):
    """An OS error that a user can fix (a full disk, a read-only file system, a name too long) as one
    line naming the path and the fix, instead of a traceback."""
    try:
        yield
    except OSError as e:
        if e.errno not in FIXES:
            raise
        name, fix = str(e.filename or path), FIXES[e.errno]
        if e.errno == errno.ENAMETOOLONG and max(len(c.encode()) for c in name.split(os.sep)) <= 255:
            fix = f"the path is {len(name.encode()):,} bytes, longer than the system allows: choose a shorter one"
        if len(name) > 160:  # a path too long to read whole: its two ends
            name = f"{name[:60]}...{name[-60:]}"
        raise SystemExit(f"{name}: cannot {what}: {fix}") from None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _release(lock, me):
    try:
        with open(lock) as f:
            if f.read() == me:
                os.remove(lock)
    except OSError:
        pass


def shard_name(grid, zero1):
    return f"tp{grid.tp_rank}_pp{grid.pp_rank}" + (f"_dp{grid.dp_rank}" if zero1 else "") + ".pt"


def new_run_id(grid):
    """A run's identity: drawn on rank 0, the same on every rank."""
    ids = [secrets.token_hex(8)]
    if grid.world > 1:
        dist.broadcast_object_list(ids, src=0)
    return ids[0]


HASH_PIECE = 1 << 24  # bytes read at a time to hash a file (a shard can be many GB)


def sha256_of(path):
    """The file's sha256, read HASH_PIECE bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(HASH_PIECE), b""):
            h.update(piece)
    return h.hexdigest()


def write_file(obj, path):
    """torch.save to path (through path.tmp: never half a file); returns its sha256. A write that fails
    (torch.save reports a full disk as a RuntimeError) ends the run with one line; the previous set stays."""
    try:
        torch.save(obj, path + ".tmp")
    except RuntimeError as e:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        free = shutil.disk_usage(os.path.dirname(path) or ".").free / 2**20
        raise SystemExit(
            f"{path}: cannot write the checkpoint ({str(e).splitlines()[0][:120]}; {free:.0f} MiB free "
            f"on its disk): free space or choose another --out_dir; the previous complete set is kept"
        ) from None
    os.replace(path + ".tmp", path)
    return sha256_of(path)


def _write_atomic(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def mark_complete(folder, meta):
    """COMPLETE: the set's iteration, layout, run id and {file: sha256}, written atomically."""
    _write_atomic(os.path.join(folder, "COMPLETE"), json.dumps(meta))


META_KEYS = ("iter", "tp", "pp", "dp", "zero1", "run_id", "files")


def read_complete(folder):
    """A set's COMPLETE, or an error naming it when it is not what mark_complete writes."""
    path = os.path.join(folder, "COMPLETE")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        meta = None
    if isinstance(meta, dict) and "iter" in meta and "files" not in meta:
        raise SystemExit(
            f"{path} records no run id and checksums: the set was written before checkpoints "
            f"carried them, and cannot be verified; start anew (--overwrite)"
        )
    if not (isinstance(meta, dict) and all(k in meta for k in META_KEYS) and isinstance(meta["files"], dict)):
        raise SystemExit(
            f"{path} is damaged (not the record a finished save writes: iteration, layout, run id, "
            f"checksums): delete {folder} to resume from an older set, or start anew"
        )
    return meta


def _read(path):
    """A small text file's content, or "" where there is none."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def sets(out_dir, complete=True):
    """The checkpoint sets under out_dir, oldest first (only complete ones by default)."""
    found = sorted(glob.glob(os.path.join(out_dir, "ckpt", "iter_*")))
    return [d for d in found if not complete or os.path.exists(os.path.join(d, "COMPLETE"))]


def save(r, it):
    """Every writer rank writes its file into the step's folder; after a barrier rank 0 marks
    the set complete and removes every other set. Returns the set's folder."""
    cfg, grid = r.cfg, r.grid
    folder = os.path.join(cfg.out_dir, "ckpt", f"iter_{it:08d}")
    mine = None
    if grid.dp_rank == 0 or cfg.zero1:
        name = shard_name(grid, cfg.zero1)
        with os_errors(folder, "save the checkpoint"):
            os.makedirs(folder, exist_ok=True)
            mine = (
                name,
                write_file(
                    {
                        "model": r.model.state_dict(),
                        "optimizer": r.opt.state_dict(),
                        "iter": it,
                        "config": cfg.as_dict(),
                        "model_config": dataclasses.asdict(r.model.config),
                        "layout": [grid.tp, grid.pp],
                        "run_id": r.run_id,
                    },
                    os.path.join(folder, name),
                ),
            )
    every = [mine]
    if grid.world > 1:  # also the barrier: every file is written from here on
        every = [None] * grid.world
        dist.all_gather_object(every, mine)
    if grid.rank == 0:
        with os_errors(folder, "save the checkpoint"):
            mark_complete(
                folder,
                {
                    "iter": it,
                    "tp": grid.tp,
                    "pp": grid.pp,
                    "dp": grid.dp,
                    "zero1": cfg.zero1,
                    "run_id": r.run_id,
                    "files": dict(e for e in every if e),
                },
            )
            _write_atomic(os.path.join(cfg.out_dir, "RUN"), r.run_id)  # the out_dir's own run
        for old in sets(cfg.out_dir, complete=False):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
    return folder


def load_file(path, meta, device="cpu"):
    """One shard file of a set whose COMPLETE is `meta`: its bytes must have the recorded sha256
    and it must be of the set's run; a damaged, changed or foreign file is an error naming it."""
    name, folder = os.path.basename(path), os.path.dirname(path)
    if name not in meta["files"]:
        raise SystemExit(
            f"{path} is not in its set (COMPLETE lists {sorted(meta['files'])}): the set was written at another "
            f"layout (tp {meta.get('tp')} x pp {meta.get('pp')}, zero1 {meta.get('zero1')}): resume with that layout"
        )
    if not os.path.exists(path):
        raise SystemExit(
            f"{path} is missing: its set lists it (COMPLETE), but the file was deleted or never copied. Restore "
            f"it, or delete {folder} to resume from an older set"
        )
    if sha256_of(path) != meta["files"][name]:
        try:  # only to say what it is
            ck = torch.load(path, map_location="cpu", weights_only=False)
            run = ck.get("run_id") if isinstance(ck, dict) else None
            why = (
                f"comes from another run ({run}, this set's is {meta['run_id']})"
                if run != meta["run_id"]
                else "was changed after it was saved"
            )
        except Exception as e:
            why = f"cannot be read ({type(e).__name__}: {e})"
        raise SystemExit(
            f"checkpoint file {path} does not match the checksum in COMPLETE: it {why}. Delete "
            f"{folder} to resume from an older set, or start anew"
        ) from None
    return torch.load(path, map_location=device, weights_only=False)


def resume(r):
    """Load the newest complete set into r.model / r.opt; every file must match its checksum and
    be of the set's run, every rank must have loaded the same iteration, and the set's model and
    layout must be this run's. Sets r.run_id (the run goes on under its identity); returns the folder."""
    cfg, grid = r.cfg, r.grid
    found = [cfg.resume_from] if cfg.resume_from else sets(cfg.out_dir)
    if not found:
        cut = [os.path.basename(s) for s in sets(cfg.out_dir, complete=False)]
        hint = (
            f"only {', '.join(cut)}, cut short before its save finished: --overwrite starts over"
            if cut
            else "start without --resume, or save on the way with --ckpt_interval"
        )
        raise SystemExit(f"--resume: no complete checkpoint set under {cfg.out_dir}/ckpt ({hint})")
    meta = read_complete(found[-1])
    own = _read(os.path.join(cfg.out_dir, "RUN"))
    if not own and not cfg.resume_from:  # every save writes RUN: sets without it were put here from elsewhere
        raise SystemExit(
            f"--resume: {cfg.out_dir} has no RUN file (written with every set), so {found[-1]} (run "
            f"{meta['run_id']}) is not known to be its own: take it on purpose with --resume_from={found[-1]}"
        )
    if meta["run_id"] != own and not cfg.resume_from:
        raise SystemExit(
            f"--resume: the newest set {found[-1]} is of run {meta['run_id']}, not of {cfg.out_dir}'s "
            f"own run {own} (its RUN): take it on purpose with --resume_from={found[-1]}, or remove it"
        )
    if meta["iter"] >= cfg.max_iters:
        raise SystemExit(
            f"--resume: {found[-1]} is at iteration {meta['iter']}, and max_iters={cfg.max_iters}: "
            f"nothing left to train; pass a larger --max_iters"
        )
    ck = load_file(os.path.join(found[-1], shard_name(grid, cfg.zero1)), meta, r.dev)
    saved = {**saved_model_config(ck), **{k: ck["config"].get(k) for k in LAYOUT_KEYS}}
    given = {**dataclasses.asdict(r.model.config), **{k: getattr(cfg, k) for k in LAYOUT_KEYS}}
    mine = (ck["iter"], sorted(saved.items()))
    if grid.world > 1:
        every = [None] * grid.world
        dist.all_gather_object(every, mine)
        if any(e != mine for e in every):
            raise SystemExit(f"--resume: the ranks' checkpoint files disagree (iteration, model, layout): {every}")
    wrong = [
        f"{k} (saved {saved[k]!r}, given {given[k]!r})" for k in given if k not in CHANGEABLE and saved[k] != given[k]
    ]
    if wrong:
        raise SystemExit(
            f"--resume: {found[-1]} holds another model or layout than this run's: {', '.join(wrong)}; pass "
            f"the saved values, or another --out_dir for a new run"
        )
    r.model.load_state_dict(ck["model"])
    r.opt.load_state_dict(ck["optimizer"])
    r.it0, r.run_id = ck["iter"], meta["run_id"]
    return found[-1]


def saved_model_config(ck):
    """The model config a set's file was saved with, as a dict (sets before the families were parts
    record only the settings: arch and one bias flag)."""
    if "model_config" in ck:
        return ck["model_config"]
    old = dict(ck["config"])
    family, bias = old.pop("arch", "gpt2"), old.pop("bias", True)  # `bias` switched the family's biases
    parts = {p: bias for p in ("qkv_bias", "linear_bias", "norm_bias") if getattr(FAMILIES[family], p)}
    return dataclasses.asdict(GPTConfig.from_settings({**old, "family": family, **parts}))


# -----------------------------------------------------------------------------
# full state dicts: shards merged, and sliced again


def _stage_and_local(name, n_layer, pp):
    """The pipeline stage that holds a full-model parameter, and its name there."""
    if name.startswith("h."):
        i, rest = name[2:].split(".", 1)
        per = n_layer // pp
        return int(i) // per, f"h.{int(i) % per}.{rest}"
    return (pp - 1 if name.startswith(("ln_f", "lm_head")) else 0), name


def _unshard(mod, attr, parts):
    if isinstance(mod, ColumnParallelLinear):  # each rank holds its slice of every section
        secs = [p.split([n // len(parts) for n in mod.sections], dim=0) for p in parts]
        return torch.cat([torch.cat([s[i] for s in secs], dim=0) for i in range(len(mod.sections))], dim=0)
    return torch.cat(parts, dim=1 if isinstance(mod, RowParallelLinear) and attr == "weight" else 0)


def merge(folder):
    """(GPTConfig, full state dict, the run's config) of a complete set, on the CPU."""
    meta = read_complete(folder)
    tp, pp = meta["tp"], meta["pp"]
    shards = {}
    for t in range(tp):
        for p in range(pp):
            name = f"tp{t}_pp{p}" + ("_dp0" if meta["zero1"] else "") + ".pt"
            ck = load_file(os.path.join(folder, name), meta)
            shards[t, p], cfg = ck["model"], ck["config"]
    mc = GPTConfig(**saved_model_config(ck))
    out = {}
    full = GPT(mc, seed=None)
    for name, param in full.named_parameters():
        stage, local = _stage_and_local(name, mc.n_layer, pp)
        parts = [shards[t, stage][local] for t in range(tp)]
        prefix, attr = name.rsplit(".", 1)
        out[name] = _unshard(full.get_submodule(prefix), attr, parts) if getattr(param, "tp_split", False) else parts[0]
    if mc.tie_embeddings:
        out["lm_head.weight"] = out["wte.weight"]
    return mc, out, cfg


@torch.no_grad()
def shard_into(model, get):
    """Copy a full model into this rank's model (its stage's blocks, its TP slices), one tensor at a
    time: get(full name) gives it (a full state dict's __getitem__, or from_hf's reader)."""
    for name, param in model.named_parameters():
        g = name
        if name.startswith("h."):
            i, rest = name[2:].split(".", 1)
            g = f"h.{model.layers[int(i)]}.{rest}"
        src = get(g)
        mod = model.get_submodule(name.rsplit(".", 1)[0])
        try:
            mine = mod.shard(src) if getattr(param, "tp_split", False) else src
        except RuntimeError:  # sections that do not add up
            mine = None
        if mine is None or mine.shape != param.shape:
            raise ValueError(
                f"{g}: the weights hold shape {tuple(src.shape)}, which does not fit this model ({model.config})"
            )
        param.copy_(mine)
