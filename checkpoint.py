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
initialisation uses). Hugging Face GPT-2 weights convert to and from it (hf_to_full, full_to_hf).
"""
import atexit
import glob
import hashlib
import json
import os
import secrets
import shutil
import socket

import torch
import torch.distributed as dist

from model import GPT, ColumnParallelLinear, GPTConfig, RowParallelLinear

SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "tp", "pp", "zero1")


def claim(out_dir, resume, overwrite, rank0):
    """Refuse a new run into an out_dir that holds another run's checkpoints (unless resume, or
    overwrite, which deletes them); rank 0 holds out_dir/LOCK while it runs, so a second run into
    the same out_dir at the same time is refused (a LOCK whose process is gone is taken over)."""
    found = sets(out_dir, complete=False)
    if found and not resume and not overwrite:
        go_on = "--resume continues it, " if sets(out_dir) else "none complete (cut short), so "
        raise SystemExit(f"{out_dir} holds another run's checkpoints ({os.path.basename(found[-1])}): {go_on}"
                         f"--overwrite starts over (deleting them), or choose another --out_dir")
    if not rank0:
        return
    os.makedirs(out_dir, exist_ok=True)
    lock, me = os.path.join(out_dir, "LOCK"), f"{socket.gethostname()} {os.getpid()}"
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, me.encode())
            os.close(fd)
            break
        except FileExistsError:
            with open(lock) as f:
                host, _, pid = f.read().partition(" ")
            if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
                os.remove(lock)                                   # its run is gone
                continue
            raise SystemExit(f"{out_dir} is in use by another run (process {pid or '?'} on {host or '?'}): choose "
                             f"another --out_dir, or delete {lock} if that run is gone") from None
    atexit.register(_release, lock, me)
    if overwrite and not resume:
        shutil.rmtree(os.path.join(out_dir, "ckpt"), ignore_errors=True)


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


def sha256_of(path):
    """The file's sha256, read in 16 MiB pieces (a shard can be many GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 24), b""):
            h.update(piece)
    return h.hexdigest()


def write_file(obj, path):
    """torch.save to path (through path.tmp: never half a file); returns its sha256."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)
    return sha256_of(path)


def mark_complete(folder, meta):
    """COMPLETE: the set's iteration, layout, run id and {file: sha256}, written atomically."""
    with open(os.path.join(folder, "COMPLETE.tmp"), "w") as f:
        json.dump(meta, f)
    os.replace(os.path.join(folder, "COMPLETE.tmp"), os.path.join(folder, "COMPLETE"))


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
        raise SystemExit(f"{path} records no run id and checksums: the set was written before checkpoints "
                         f"carried them, and cannot be verified; start anew (--overwrite)")
    if not (isinstance(meta, dict) and all(k in meta for k in META_KEYS) and isinstance(meta["files"], dict)):
        raise SystemExit(f"{path} is damaged (not the record a finished save writes: iteration, layout, run id, "
                         f"checksums): delete {folder} to resume from an older set, or start anew")
    return meta


def sets(out_dir, complete=True):
    """The checkpoint sets under out_dir, oldest first (only complete ones by default)."""
    found = sorted(glob.glob(os.path.join(out_dir, "ckpt", "iter_*")))
    return [d for d in found if not complete or os.path.exists(os.path.join(d, "COMPLETE"))]


def save(r, it):
    """Every writer rank writes its file into the step's folder; after a barrier rank 0 marks
    the set complete and removes every other set."""
    c, grid = r.cfg, r.grid
    folder = os.path.join(c["out_dir"], "ckpt", f"iter_{it:08d}")
    mine = None
    if grid.dp_rank == 0 or c["zero1"]:
        os.makedirs(folder, exist_ok=True)
        name = shard_name(grid, c["zero1"])
        mine = (name, write_file({"model": r.model.state_dict(), "optimizer": r.opt.state_dict(), "iter": it,
                                  "config": c, "layout": [grid.tp, grid.pp], "run_id": r.run_id},
                                 os.path.join(folder, name)))
    every = [mine]
    if grid.world > 1:                           # also the barrier: every file is written from here on
        every = [None] * grid.world
        dist.all_gather_object(every, mine)
    if grid.rank == 0:
        mark_complete(folder, {"iter": it, "tp": grid.tp, "pp": grid.pp, "dp": grid.dp, "zero1": c["zero1"],
                               "run_id": r.run_id, "files": dict(e for e in every if e)})
        for old in sets(c["out_dir"], complete=False):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)


def load_file(path, meta, device="cpu"):
    """One shard file of a set whose COMPLETE is `meta`: its bytes must have the recorded sha256
    and it must be of the set's run; a damaged, changed or foreign file is an error naming it."""
    name, folder = os.path.basename(path), os.path.dirname(path)
    if name not in meta["files"] or not os.path.exists(path):
        raise SystemExit(f"{path} is missing from its set (COMPLETE lists {sorted(meta['files'])}): the set was "
                         f"written by another layout")
    if sha256_of(path) != meta["files"][name]:
        try:                                                       # only to say what it is
            ck = torch.load(path, map_location="cpu", weights_only=False)
            run = ck.get("run_id") if isinstance(ck, dict) else None
            why = (f"comes from another run ({run}, this set's is {meta['run_id']})" if run != meta["run_id"]
                   else "was changed after it was saved")
        except Exception as e:
            why = f"cannot be read ({type(e).__name__}: {e})"
        raise SystemExit(f"checkpoint file {path} does not match the checksum in COMPLETE: it {why}. Delete "
                         f"{folder} to resume from an older set, or start anew") from None
    return torch.load(path, map_location=device, weights_only=False)


def resume(r):
    """Load the newest complete set into r.model / r.opt; every file must match its checksum and
    be of the set's run, every rank must have loaded the same iteration, and the set's model and
    layout must be this run's. Sets r.run_id (the run goes on under its identity); returns the folder."""
    c, grid = r.cfg, r.grid
    found = sets(c["out_dir"])
    if not found:
        cut = [os.path.basename(s) for s in sets(c["out_dir"], complete=False)]
        hint = (f"only {', '.join(cut)}, cut short before its save finished: --overwrite starts over" if cut else
                "start without --resume")
        raise SystemExit(f"--resume: no complete checkpoint set under {c['out_dir']}/ckpt ({hint})")
    meta = read_complete(found[-1])
    ck = load_file(os.path.join(found[-1], shard_name(grid, c["zero1"])), meta, r.dev)
    mine = (ck["iter"], [ck["config"].get(k) for k in SHAPE_KEYS])
    if grid.world > 1:
        every = [None] * grid.world
        dist.all_gather_object(every, mine)
        if any(e != mine for e in every):
            raise SystemExit(f"--resume: the ranks' checkpoint files disagree (iteration, model, layout): {every}")
    wrong = [f"{k}={ck['config'].get(k)}" for k in SHAPE_KEYS if ck["config"].get(k) != c[k]]
    if wrong:
        raise SystemExit(f"--resume: {found[-1]} was written with {', '.join(wrong)}; this run differs: "
                         f"pass those settings, or another --out_dir for a new run")
    r.model.load_state_dict(ck["model"])
    r.opt.load_state_dict(ck["optimizer"])
    r.it0, r.run_id = ck["iter"], meta["run_id"]
    return found[-1]


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
    if isinstance(mod, ColumnParallelLinear):        # each rank holds its slice of every section
        secs = [p.chunk(mod.parts, dim=0) for p in parts]
        return torch.cat([torch.cat([s[i] for s in secs], dim=0) for i in range(mod.parts)], dim=0)
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
    mc = model_config(cfg)
    out = {}
    full = GPT(mc)
    for name, param in full.named_parameters():
        stage, local = _stage_and_local(name, mc.n_layer, pp)
        parts = [shards[t, stage][local] for t in range(tp)]
        prefix, attr = name.rsplit(".", 1)
        out[name] = _unshard(full.get_submodule(prefix), attr, parts) if getattr(param, "tp_split", False) else parts[0]
    out["lm_head.weight"] = out["wte.weight"]                  # tied
    return mc, out, cfg


def model_config(cfg):
    return GPTConfig(block_size=cfg["block_size"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                     n_embd=cfg["n_embd"], dropout=cfg.get("dropout", 0.0), bias=cfg["bias"])


@torch.no_grad()
def shard_into(model, full):
    """Copy a full state dict into this rank's model (its stage's blocks, its TP slices)."""
    for name, param in model.named_parameters():
        g = name
        if name.startswith("h."):
            i, rest = name[2:].split(".", 1)
            g = f"h.{model.layers[int(i)]}.{rest}"
        src = full[g]
        prefix = name.rsplit(".", 1)[0]
        mod = model.get_submodule(prefix)
        param.copy_(mod.shard(src) if getattr(param, "tp_split", False) else src)


# -----------------------------------------------------------------------------
# Hugging Face GPT-2 (GPT2LMHeadModel): Conv1D weights are (in, out), ours (out, in)

HF_LINEARS = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}


def hf_to_full(sd, mc):
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    missing = [k for k in ("wte.weight", "wpe.weight", "ln_f.weight", f"h.{mc.n_layer - 1}.ln_1.weight") if k not in sd]
    if missing or sd["wte.weight"].shape != (mc.vocab_size, mc.n_embd) or f"h.{mc.n_layer}.ln_1.weight" in sd:
        n_layer = len({k.split(".")[1] for k in sd if k.startswith("h.")})
        raise ValueError(f"the weights do not match the model: they have n_layer={n_layer}, wte "
                         f"{tuple(sd['wte.weight'].shape) if 'wte.weight' in sd else 'missing'}; the config "
                         f"asks n_layer={mc.n_layer}, n_embd={mc.n_embd}, vocabulary {mc.vocab_size}")
    if sd["wpe.weight"].shape[0] < mc.block_size:
        raise ValueError(f"the weights have {sd['wpe.weight'].shape[0]} positions; use block_size <= that")
    full = {}
    for k, v in sd.items():
        if k.endswith((".attn.bias", ".attn.masked_bias")) or k == "lm_head.weight":
            continue                                     # causal-mask buffers; the head is tied to wte
        for hf, ours in HF_LINEARS.items():
            if f".{hf}." in k:
                k, v = k.replace(hf, ours), (v.t() if k.endswith(".weight") else v)
        full[k] = v.float().contiguous()
    wte = torch.zeros(mc.padded_vocab, mc.n_embd)
    wte[:mc.vocab_size] = full["wte.weight"]
    full["wte.weight"], full["wpe.weight"] = wte, full["wpe.weight"][:mc.block_size].contiguous()
    full["lm_head.weight"] = wte
    return full


def full_to_hf(full, mc):
    sd = {}
    for k, v in full.items():
        if k == "lm_head.weight":
            continue
        for hf, ours in HF_LINEARS.items():
            if f".{ours}." in k:
                k, v = k.replace(ours, hf), (v.t() if k.endswith(".weight") else v)
        sd["transformer." + k] = v.contiguous()
    sd["transformer.wte.weight"] = full["wte.weight"][:mc.vocab_size].contiguous()
    return sd                                                  # lm_head: tied to wte (Hugging Face ties it)


def hf_config(mc):
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": mc.vocab_size,
            "n_positions": mc.block_size, "n_ctx": mc.block_size, "n_embd": mc.n_embd, "n_layer": mc.n_layer,
            "n_head": mc.n_head, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True}


# safetensors: 8 bytes of header length, a JSON header {name: {dtype, shape, data_offsets}}, the data
ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_weights(path):
    """A state dict from a file or a folder with model.safetensors or pytorch_model.bin (local only)."""
    if os.path.isdir(path):
        found = [os.path.join(path, n) for n in ("model.safetensors", "pytorch_model.bin")
                 if os.path.exists(os.path.join(path, n))]
        if not found:
            raise ValueError(f"{path} holds neither model.safetensors nor pytorch_model.bin")
        path = found[0]
    if not path.endswith(".safetensors"):
        return torch.load(path, map_location="cpu", weights_only=True)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header, data = json.loads(f.read(n)), f.read()
    return {k: torch.frombuffer(bytearray(data[v["data_offsets"][0]:v["data_offsets"][1]]),
                                dtype=ST_DTYPES[v["dtype"]]).reshape(v["shape"]).clone()
            for k, v in header.items() if k != "__metadata__"}


def write_safetensors(sd, path):
    names = {v: k for k, v in ST_DTYPES.items()}
    header, blobs, off = {}, [], 0
    for k, v in sd.items():
        b = v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": names[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for b in blobs:
            f.write(b)
