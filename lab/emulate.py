"""
TP emulation: one process computes, bit for bit where arithmetic allows, what a TP=t group would
send and receive in every TP all-reduce, so one GPU can study TP=8 compression.

The model is built as an ordinary TP=1 GPT; emulate_tp() then replaces its tensor-parallel layers
from outside: a column-parallel layer forms its backward input gradient as t ranks would (rank r:
grad_y[..., rows_r] @ W[rows_r]), a row-parallel layer and the vocab-parallel embedding form the t
partial sums of their forward output, and every such set is combined by emulated_all_reduce: the
same shards, the same codes, the same fp32 rank-order sum as taco.all_reduce on t ranks.

    python -m lab.emulate 8 configs/study.py --tp_codec=hint8     # train.py with TP=8 emulated
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import parallel
import taco
import train
from lab import tahquant  # noqa: F401  (the codec `tahquant`, for the study)
from model import ColumnParallelLinear, GPTConfig, RowParallelLinear, VocabParallelEmbedding, autocast_input


def emulated_all_reduce(partials, codec=taco.DEFAULT_CODEC, block_size=256):
    """What taco.all_reduce returns when rank r contributes partials[r], computed in one process with
    the same arithmetic (same shards, same fp32 rank-order sum, same re-encode)."""
    cd = taco.get_codec(codec, block_size)
    W, n = len(partials), partials[0].numel()
    if cd is taco.IDENTITY:
        return taco.rank_order_sum(partials).view_as(partials[0]).to(partials[0].dtype)
    L = cd.padded(taco.cdiv(n, W))
    # all W ranks' W messages in one encode (message r*W + k: rank r's shard k; messages are
    # independent, so this is bit for bit what each rank encodes)
    x = partials[0].new_zeros(W, W * L)
    x[:, :n] = torch.stack([p.reshape(-1) for p in partials])
    sent = cd.encode(x.view(-1), W * W, L).view(W, W, -1)              # [sender, shard, byte]
    # what rank k does with the W messages for shard k (rank order), then everyone's decode
    mine = torch.stack([cd.reduce_encode(sent[:, k], L) for k in range(W)])
    return cd.decode(mine, L, n, partials[0].dtype).view_as(partials[0])


def column_rows(d_out, parts, t):
    """The output rows each of t ranks owns in a column-parallel layer: every one of `parts`
    equal sections (QKV: [Q|K|V]) cut into t pieces, rank r taking piece r of each."""
    sec = d_out // parts
    per = sec // t
    return [torch.cat([torch.arange(p * sec + r * per, p * sec + (r + 1) * per) for p in range(parts)])
            for r in range(t)]


class _EmulatedG(torch.autograd.Function):
    """g, emulated: t partial outputs combined as taco.all_reduce combines t ranks' contributions;
    backward hands every partial the same gradient."""

    @staticmethod
    def forward(ctx, comm, *partials):
        ctx.t = len(partials)
        parts = [p.contiguous() for p in partials]
        return emulated_all_reduce(parts, codec=comm.codec_for(parts[0], "fwd"), block_size=comm.block_size)

    @staticmethod
    def backward(ctx, grad):
        return (None,) + (grad,) * ctx.t


class _EmulatedF(torch.autograd.Function):
    """f and the column-parallel matmul with every product shaped as on t ranks (rank r: the rows
    it owns), so the numbers match a real TP=t run; in backward the input gradient is formed as the
    t ranks form it (grad_y[..., rows_r] @ W[rows_r]) and combined like f's all-reduce."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, rows):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias, ctx.rows = comm, bias is not None, rows
        outs = [F.linear(x, weight[r], None if bias is None else bias[r]) for r in rows]
        y = x.new_empty(*x.shape[:-1], weight.shape[0], dtype=outs[0].dtype)
        for r, o in zip(rows, outs):
            y[..., r] = o
        return y

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        comm, wd = ctx.comm, w.to(gy.dtype)
        gys = [gy[..., r].contiguous() for r in ctx.rows]
        partials = [g @ wd[r] for g, r in zip(gys, ctx.rows)]
        gx = emulated_all_reduce(partials, codec=comm.codec_for(partials[0], "bwd"), block_size=comm.block_size)
        x2 = x.reshape(-1, x.shape[-1]).to(gy.dtype)
        gw = torch.empty_like(w)
        gb = torch.empty(w.shape[0], dtype=w.dtype, device=w.device) if ctx.has_bias else None
        for g, r in zip(gys, ctx.rows):
            g2 = g.reshape(-1, g.shape[-1])
            gw[r] = (g2.t() @ x2).to(w.dtype)
            if ctx.has_bias:
                gb[r] = g2.sum(0).to(w.dtype)
        return gx.to(x.dtype), gw, gb, None, None


class EmulatedColumn(nn.Module):
    """Stands in for a ColumnParallelLinear of a TP=1 model (same parameters, same names)."""

    def __init__(self, layer, comm, t):
        super().__init__()
        self.weight, self.bias, self.comm = layer.weight, layer.bias, comm
        self.rows = column_rows(layer.weight.shape[0], layer.parts, t)

    def forward(self, x):
        return _EmulatedF.apply(autocast_input(x), self.weight, self.bias, self.comm, self.rows)


class EmulatedRow(nn.Module):
    """Stands in for a RowParallelLinear: t partial sums, as t ranks would compute them, then g."""

    def __init__(self, layer, comm, t):
        super().__init__()
        self.weight, self.bias, self.comm, self.t = layer.weight, layer.bias, comm, t

    def forward(self, x):
        xs, ws = x.chunk(self.t, dim=-1), self.weight.chunk(self.t, dim=-1)
        y = _EmulatedG.apply(self.comm, *[F.linear(a.contiguous(), w) for a, w in zip(xs, ws)])
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
        return _EmulatedG.apply(self.comm, *[VocabParallelEmbedding.lookup(idx, w, r * per)
                                             for r, w in enumerate(shards)])


def emulate_tp(model, t, comm):
    """Replace every tensor-parallel layer of a TP=1 model by its TP=t emulation, in place. comm
    (a parallel.TPComm of size 1) gives the codecs, block size and min_bytes of the emulated
    all-reduces. The parameters stay the same objects (the tied head stays tied)."""
    if comm.size != 1 or comm.sp:
        raise parallel.ConfigError("TP emulation runs on a TP=1 model without sequence parallelism")
    swap = {ColumnParallelLinear: EmulatedColumn, RowParallelLinear: EmulatedRow, VocabParallelEmbedding: EmulatedEmbedding}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in swap:
                setattr(parent, name, swap[type(child)](child, comm, t))
    return model


def check(cfg, t):
    """The emulation's own launch checks (config.check does the rest)."""
    if cfg["tp"] != 1 or cfg["pp"] != 1 or cfg["taco_chunks"] != 1 or cfg["sequence_parallel"]:
        raise SystemExit(f"config error: TP={t} emulation runs on one process: tp=1, pp=1, taco_chunks=1, "
                         f"no sequence_parallel")
    try:
        parallel.check_layout(t, 1, t, n_head=cfg["n_head"], n_embd=cfg["n_embd"],
                              vocab_size=GPTConfig().padded_vocab, n_layer=cfg["n_layer"])
    except parallel.ConfigError as e:
        raise SystemExit(f"config error: TP={t} emulated: {e}")


def main(argv):
    if not argv or not argv[0].isdigit():
        raise SystemExit("usage: python -m lab.emulate T [config.py] [--key=value ...]   (train.py, TP=T emulated)")
    t = int(argv[0])

    def hook(model, comm, cfg):
        check(cfg, t)
        emulate_tp(model, t, comm)
        print(f"TP={t} emulated in one process")
    train.main(argv[1:], model_hook=hook)


if __name__ == "__main__":
    main(sys.argv[1:])
