"""
TP emulation: one process computes, bit for bit where arithmetic allows, what a TP=t group would
send and receive in every TP all-reduce, so one GPU can study TP=8 compression.

The model is built as an ordinary TP=1 GPT; emulate_tp() then replaces its tensor-parallel layers
from outside: a column-parallel layer forms its backward input gradient as t ranks would (rank r:
grad_y[..., rows_r] @ W[rows_r]), a row-parallel layer and the vocab-parallel embedding form the t
partial sums of their forward output, and every such set is combined by emulated_all_reduce: the
same shards, the same codes, the same fp32 rank-order sum as taco.all_reduce on t ranks.

    python -m lab.emulate 8 configs/study.py --tp_codec=hint8     # train.py with TP=8 emulated
    python -m lab.emulate 8 --sites=mlp configs/study.py --tp_codec=hint8        # compress only the MLP's
    python -m lab.emulate 8 --sites=attn=hint6,mlp,ends configs/study.py --tp_codec=hint8   # a codec per site
    python -m lab.emulate 8 --graph configs/study_long.py --tp_codec=hint8       # steps replayed as CUDA graphs

Sites: `attn` (the attention block's all-reduces: its output projection's forward, its QKV
input gradient), `mlp` (likewise for the MLP), `ends` (the token embedding's forward, the LM head's
input gradient). Unlisted sites stay uncompressed; `site=codec` overrides the codec there (both
directions, where the direction's own setting compresses at all).
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import config
import taco
import train
from lab import tahquant  # noqa: F401  (the codec `tahquant`, for the study)
from loss import fused_linear_cross_entropy
from model import (
    ColumnParallelLinear,
    LMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    autocast_input,
)


def emulated_all_reduce(partials, codec=taco.DEFAULT_CODEC, codec_block=256):
    """What taco.all_reduce returns when rank r contributes partials[r], computed in one process with
    the same arithmetic (same shards, same fp32 rank-order sum, same re-encode)."""
    cd = taco.get_codec(codec, codec_block)
    W, n = len(partials), partials[0].numel()
    if cd is taco.IDENTITY:
        return taco.rank_order_sum(partials).view_as(partials[0]).to(partials[0].dtype)
    L = cd.padded(taco.cdiv(n, W))
    # all W ranks' W messages in one encode (message r*W + k: rank r's shard k; messages are
    # independent, so this is bit for bit what each rank encodes)
    x = torch.stack([p.reshape(-1) for p in partials])  # (W, n): row r is rank r's partial
    if n < W * L:  # zero padding to whole blocks
        x = torch.cat([x, x.new_zeros(W, W * L - n)], dim=1)
    sent = cd.encode(x.view(-1), W * W, L).view(W, W, -1)  # [sender, shard, byte]
    # what rank k does with the W messages for shard k (rank order), then everyone's decode
    received = sent.transpose(0, 1).contiguous()  # [shard, sender, byte]
    mine = torch.stack([cd.reduce_encode(received[k], L) for k in range(W)])
    return cd.decode(mine, L, n, partials[0].dtype).view_as(partials[0])


def by_rank(a, dim, sections, t):
    """The shares of t ranks in a column-parallel dimension of `a` (a weight's rows, a bias, an
    output's last dimension), rank-major in one copy: [r] is rank r's share, contiguous — every one
    of the sections (sizes along dim; QKV: [Q|K|V]) cut into t pieces, piece r of each."""
    pieces = [s.chunk(t, dim) for s in a.split(list(sections), dim)]
    return torch.stack([torch.cat([p[r] for p in pieces], dim) for r in range(t)])


def from_ranks(pieces, dim, sections):
    """The inverse of by_rank: t ranks' shares (a list, or stacked) back in the full layout."""
    t = len(pieces)
    shares = [p.split([n // t for n in sections], dim) for p in pieces]
    return torch.cat([shares[r][i] for i in range(len(sections)) for r in range(t)], dim)


class _EmulatedG(torch.autograd.Function):
    """g, emulated: t partial outputs combined as taco.all_reduce combines t ranks' contributions;
    backward hands every partial the same gradient."""

    @staticmethod
    def forward(ctx, comm, direction, *partials):
        ctx.t = len(partials)
        parts = [p.contiguous() for p in partials]
        return emulated_all_reduce(parts, codec=comm.codec_for(parts[0], direction), codec_block=comm.codec_block)

    @staticmethod
    def backward(ctx, grad):
        return (None, None) + (grad,) * ctx.t


class _EmulatedF(torch.autograd.Function):
    """f and the column-parallel matmul with every product shaped as on t ranks (rank r: the rows
    it owns), so the numbers match a real TP=t run; in backward the input gradient is formed as the
    t ranks form it (grad_y[..., rows_r] @ W[rows_r]) and combined like f's all-reduce."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, parts, t):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias, ctx.parts, ctx.t = comm, bias is not None, parts, t
        ws = by_rank(weight, 0, parts, t)
        bs = [None] * t if bias is None else by_rank(bias, 0, parts, t)
        return from_ranks([F.linear(x, ws[r], bs[r]) for r in range(t)], x.dim() - 1, parts)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        comm, parts, t = ctx.comm, ctx.parts, ctx.t
        gys = by_rank(gy.contiguous(), gy.dim() - 1, parts, t)
        wd = by_rank(w.to(gy.dtype), 0, parts, t)
        partials = [gys[r] @ wd[r] for r in range(t)]
        gx = emulated_all_reduce(partials, codec=comm.codec_for(partials[0], "bwd"), codec_block=comm.codec_block)
        x2 = x.reshape(-1, x.shape[-1]).to(gy.dtype)
        g2 = [g.reshape(-1, g.shape[-1]) for g in gys]
        gw = from_ranks(torch.stack([g.t() @ x2 for g in g2]).to(w.dtype), 0, parts)
        gb = from_ranks(torch.stack([g.sum(0) for g in g2]).to(w.dtype), 0, parts) if ctx.has_bias else None
        return gx.to(x.dtype), gw, gb, None, None, None


class EmulatedColumn(nn.Module):
    """Stands in for a ColumnParallelLinear of a TP=1 model (same parameters, same names)."""

    def __init__(self, layer, comm, t):
        super().__init__()
        self.weight, self.bias, self.comm, self.parts, self.t = layer.weight, layer.bias, comm, layer.sections, t
        self.local, self.split = layer.local, layer.split  # this rank's sections; one tensor each (SwiGLU)?

    def forward(self, x):
        y = _EmulatedF.apply(autocast_input(x), self.weight, self.bias, self.comm, self.parts, self.t)
        return y.split(self.local, dim=-1) if self.split else y


class _EmulatedGrad(torch.autograd.Function):
    """Identity forward; backward, the input gradient through the emulated all-reduce of one rank
    (what the site's codec makes of it), as EmulatedColumn treats its gradient at t = 1."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        codec = ctx.comm.codec_for(g, "bwd")
        return emulated_all_reduce([g], codec=codec, codec_block=ctx.comm.codec_block).to(g.dtype), None


class EmulatedHead(EmulatedColumn):
    """Stands in for the LM head. At t = 1, the book's own fused loss (so a t = 1 emulation is the
    book's TP=1 run bit for bit); at t > 1, its logits as t vocabulary shards form them (EmulatedColumn:
    the input gradient from t partial products, combined like f's all-reduce), then the loss over the
    real columns: the same loss, rounded as one fp32 cross-entropy rather than t ranks' chunks."""

    def loss(self, x, targets, n_real, chunk):
        if self.t == 1:
            x = _EmulatedGrad.apply(autocast_input(x), self.comm)
            book = getattr(self.comm, "comm", self.comm)  # a SiteComm's TPComm (size 1: no all-reduce)
            return fused_linear_cross_entropy(
                x.flatten(0, -2), self.weight, targets.flatten(), book, n_real, chunk, torch.is_grad_enabled()
            )
        logits = self(x).float()
        pad = torch.arange(logits.shape[-1], device=logits.device) >= n_real
        return F.cross_entropy(logits.masked_fill(pad, -torch.inf).flatten(0, 1), targets.flatten(), ignore_index=-1)


class EmulatedRow(nn.Module):
    """Stands in for a RowParallelLinear: t partial sums, as t ranks would compute them, then g."""

    def __init__(self, layer, comm, t):
        super().__init__()
        self.weight, self.bias, self.comm, self.t = layer.weight, layer.bias, comm, t

    def forward(self, x):
        xs, ws = by_rank(x, x.dim() - 1, (x.shape[-1],), self.t), self.weight.chunk(self.t, dim=-1)
        y = _EmulatedG.apply(self.comm, "fwd", *[F.linear(xs[r], w) for r, w in enumerate(ws)])
        return y if self.bias is None else y + self.bias


class EmulatedEmbedding(nn.Module):
    """Stands in for a VocabParallelEmbedding: t vocabulary shards' partial lookups, then g."""

    def __init__(self, layer, comm, t):
        super().__init__()
        self.weight, self.comm, self.t = layer.weight, comm, t
        self.start = 0

    def forward(self, idx):
        shards = self.weight.chunk(self.t, dim=0)
        per = shards[0].shape[0]
        return _EmulatedG.apply(
            self.comm, "fwd", *[VocabParallelEmbedding.lookup(idx, w, r * per) for r, w in enumerate(shards)]
        )


SITES = ("attn", "mlp", "ends")


class SiteComm:
    """The TPComm as one site sees it: `codec` replaces the codec it would choose ("none" turns the
    site's compression off; the direction's own "none" and min_bytes still hold)."""

    def __init__(self, comm, codec):
        self.comm, self.codec, self.codec_block = comm, codec, comm.codec_block

    def codec_for(self, x, direction):
        chosen = self.comm.codec_for(x, direction)
        return chosen if chosen == "none" else self.codec


def parse_sites(spec):
    """ "attn=hint6,mlp" -> {"attn": "hint6", "mlp": None, "ends": "none"}: None keeps the run's codec."""
    sites = dict.fromkeys(SITES, "none")
    for item in filter(None, spec.split(",")):
        site, _, codec = item.partition("=")
        if site not in SITES:
            raise SystemExit(f"--sites: unknown site {site!r} (sites: {', '.join(SITES)})")
        sites[site] = codec or None
    return sites


def site_of(name):
    """The site of a tensor-parallel layer from its module path (h.3.attn.qkv -> attn)."""
    return next((s for s in ("attn", "mlp") if f".{s}." in f".{name}."), "ends")


def emulate_tp(model, t, comm, sites=None):
    """Replace every tensor-parallel layer of a TP=1 model by its TP=t emulation, in place. comm
    (a parallel.TPComm of size 1) gives the codecs, block size and min_bytes of the emulated
    all-reduces (each layer's own comm: TPComm.at gives a block part its codec); sites (from
    parse_sites; None: as the model's layers say) narrows or changes the codec per site. The
    parameters stay the same objects (the tied head stays tied)."""
    if comm.size != 1 or comm.sp:
        raise config.ConfigError("TP emulation runs on a TP=1 model without sequence parallelism")
    swap = {
        LMHead: EmulatedHead,
        ColumnParallelLinear: EmulatedColumn,
        RowParallelLinear: EmulatedRow,
        VocabParallelEmbedding: EmulatedEmbedding,
    }
    for name, child in list(model.named_modules()):
        if type(child) in swap:
            codec = (sites or {}).get(site_of(name))
            parent, _, attr = name.rpartition(".")
            site_comm = child.comm if codec is None else SiteComm(child.comm, codec)  # the book's site codec, or ours
            setattr(model.get_submodule(parent), attr, swap[type(child)](child, site_comm, t))
    return model


class _LossOnly(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        return self.model(idx, targets)[1]


def capture(model, cfg):
    """--graph: the emulated model's training forward and backward captured once as CUDA graphs
    (torch.cuda.make_graphed_callables) and replayed every micro-batch, without the thousands of
    Python-issued launches an emulated step makes. The forward and the weight gradients are the eager
    ones bit for bit, the bias gradients (sums over rows) may round differently, so a graph run is
    not an eager run's twin (tests/test_emulation.py). Evaluation (no grad, eval mode) and other
    shapes run eagerly. One micro-batch per step only: the replayed backward writes its
    gradients into the same buffers every time, which a second micro-batch would overwrite."""
    if cfg.gradient_accumulation_steps != 1 or not next(model.parameters()).is_cuda:
        raise SystemExit("config error: --graph needs a CUDA GPU and gradient_accumulation_steps=1")
    dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.dtype]
    dev = next(model.parameters()).device
    idx = torch.zeros(cfg.batch_size, cfg.block_size, dtype=torch.long, device=dev)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32, cache_enabled=False):
        graphed = torch.cuda.make_graphed_callables(_LossOnly(model), (idx, idx.clone()))
    eager = model.forward

    def forward(idx, targets=None, hidden=None):
        if (
            model.training
            and torch.is_grad_enabled()
            and targets is not None
            and idx.shape == targets.shape
            and tuple(idx.shape) == (cfg.batch_size, cfg.block_size)
        ):
            return None, graphed(idx, targets)
        return eager(idx, targets, hidden)

    model.forward = forward


def check(cfg, t):
    """The emulation's own launch checks (config.check does the rest)."""
    if cfg.tp != 1 or cfg.pp != 1 or cfg.taco_chunks != 1 or cfg.sequence_parallel:
        raise SystemExit(
            f"config error: TP={t} emulation runs on one process: tp=1, pp=1, taco_chunks=1, no sequence_parallel"
        )
    try:
        config.check_layout(t, 1, t, mc=cfg.model_config())
    except config.ConfigError as e:
        raise SystemExit(f"config error: TP={t} emulated: {e}")


def main(argv):
    if not argv or not argv[0].isdigit():
        raise SystemExit(
            "usage: python -m lab.emulate T [--sites=SPEC] [--graph] [config.py] [--key=value ...]   "
            "(train.py, TP=T emulated)"
        )
    t, argv, spec, graph = int(argv[0]), argv[1:], None, False
    while argv and (argv[0].startswith("--sites=") or argv[0] == "--graph"):  # the emulation's own options
        arg = argv.pop(0)
        spec, graph = (arg.split("=", 1)[1], graph) if arg.startswith("--sites=") else (spec, True)
    sites = parse_sites(spec) if spec is not None else None

    def hook(model, comm, cfg):
        check(cfg, t)
        emulate_tp(model, t, comm, sites)
        if graph:
            capture(model, cfg)
        print(
            f"TP={t} emulated in one process"
            + (f", sites {spec}" if sites else "")
            + (", CUDA graphs" if graph else "")
        )

    train.main(argv, model_hook=hook)


if __name__ == "__main__":
    main(sys.argv[1:])
