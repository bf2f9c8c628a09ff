"""
Process groups and the communication that tensor, pipeline and data parallelism need.

The rank grid (Megatron convention, tensor-parallel varying fastest):

    ranks = torch.arange(world).view(dp, pp, tp)

so the tp ranks of one model replica are neighbours (same node, fastest link). Every rank belongs
to one TP group (a row of the grid), one PP group and one DP group.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, Section 3) needs two conjugate operators:

    f   forward: identity          backward: all-reduce   (before a column-parallel layer)
    g   forward: all-reduce        backward: identity     (after a row-parallel layer)

f always precedes a column-parallel matmul, so f is written fused with it (`f(x, A, b, comm)` =
x A^T + b): its backward can then START the all-reduce of the input gradient and compute the weight
gradient while the bytes are on the wire. Both operators reach the network through ONE method,
`TPComm.all_reduce`, where taco.py compresses the traffic (TACO paper, Fig. 2: the forward g and
the backward f carry activations and activation gradients of size B*T*C).

With sequence parallelism (Korthikanti et al. 2022) the activations between the TP blocks are
sharded along the sequence: f all-gathers in forward and reduce-scatters in backward, g the
reverse (the two halves of the all-reduce), through taco.all_gather / taco.reduce_scatter, so they
are compressed too.

Pipeline parallelism splits the blocks over pp stages and runs microbatches through them with a
GPipe or 1F1B schedule (point-to-point sends of the (B, T, C) activations and their gradients).
Data parallelism is in data_parallel.py.
"""

import datetime
import math
import os
import socket
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

import taco

SCHEDULES = ("1f1b", "gpipe")


# -----------------------------------------------------------------------------
# the rank grid


@dataclass
class Grid:
    rank: int = 0
    world: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    tied_group: object = None  # first and last pipeline stage of this (dp, tp) position (tied wte)
    procs: list = field(default_factory=list)  # (host, pid) of every rank (watchdog.py)

    @property
    def last_stage_rank(self):
        """The global rank of the last pipeline stage of this rank's pipeline (same dp, tp)."""
        return self.rank + (self.pp - 1 - self.pp_rank) * self.tp


def init_grid(tp=1, pp=1, backend=None, timeout=None):
    """Read torchrun's environment, init the default process group and build the TP/PP/DP groups.
    Without torchrun (no WORLD_SIZE) this is a single process and no group is created. A collective
    that waits longer than `timeout` seconds for a stalled rank raises (gloo) or aborts (NCCL)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % (tp * pp):  # config.check_layout says more, before launch
        raise ValueError(f"the world size {world} is not a multiple of tp*pp = {tp * pp}")
    dp = world // (tp * pp)
    if world == 1 and not dist.is_initialized():
        return Grid(tp=tp, pp=pp, dp=dp)
    timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (the symm transport uses peer loads)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend or ("nccl" if torch.cuda.is_available() else "gloo"), timeout=timeout)
    rank = dist.get_rank()
    grid = Grid(rank=rank, world=world, tp=tp, pp=pp, dp=dp)
    ranks = torch.arange(world).view(dp, pp, tp)
    # every rank must create every group, in the same order (torch.distributed's rule)
    rows = {
        "tp_group": [ranks[d, p, :] for d in range(dp) for p in range(pp)],
        "pp_group": [ranks[d, :, t] for d in range(dp) for t in range(tp)],
        "dp_group": [ranks[:, p, t] for p in range(pp) for t in range(tp)],
        "tied_group": [ranks[d, [0, pp - 1], t] for d in range(dp) for t in range(tp)] if pp > 1 else [],
    }
    for attr, groups in rows.items():
        for members in groups:
            g = dist.new_group(members.tolist(), timeout=timeout)
            if rank in members.tolist():
                setattr(grid, attr, g)
    (grid.dp_rank,), (grid.pp_rank,), (grid.tp_rank,) = [x.tolist() for x in (ranks == rank).nonzero(as_tuple=True)]
    grid.procs = [None] * world
    dist.all_gather_object(grid.procs, (socket.gethostname(), os.getpid()))
    return grid


# -----------------------------------------------------------------------------
# tensor parallelism: the one TP all-reduce, and the f / g operators built on it


@dataclass
class TPComm:
    """Everything a tensor-parallel layer needs to talk to its TP peers.

    fwd_codec compresses the forward all-reduce (g: activations after a row-parallel layer);
    bwd_codec the backward one (f: activation gradients before a column-parallel layer);
    site_codecs {"attn" | "mlp": codec} a block part's all-reduces, where their direction compresses;
    embed_codec the token embedding's forward all-reduce ("": fwd_codec), whose error reaches every layer.
    at(site) gives a site its own TPComm. "none" is a plain torch.distributed.all_reduce; so is any
    tensor under min_bytes."""

    group: object = None
    size: int = 1
    rank: int = 0
    fwd_codec: str = "none"
    bwd_codec: str = "none"
    embed_codec: str = ""
    codec_block: int = 256  # elements per codec block
    chunks: int = 1
    min_bytes: int = 0
    stats: taco.CommStats = field(default_factory=taco.CommStats)
    sp: bool = False  # sequence parallelism: activations outside the TP blocks are (B, T/tp, C)
    transport: str = "auto"  # taco.TRANSPORTS: auto | dist (NCCL, gloo) | symm (symmetric memory)
    site_codecs: dict = field(default_factory=dict)

    def at(self, site):
        """The TPComm of one site, with the same group and stats: "attn" or "mlp" (a block part: its
        codec from site_codecs replaces each direction's, where that direction compresses at all), or
        "embed" (the token embedding: embed_codec replaces the forward codec)."""
        if site == "embed":
            return replace(self, fwd_codec=self.embed_codec or self.fwd_codec, site_codecs={})
        k = self.site_codecs.get(site)
        if not k:
            return self
        fwd, bwd = (k if codec != "none" else "none" for codec in (self.fwd_codec, self.bwd_codec))
        return replace(self, fwd_codec=fwd, bwd_codec=bwd, site_codecs={})

    def codec_for(self, x, direction):
        """The codec for a TP collective of x in direction "fwd" or "bwd"."""
        codec = self.fwd_codec if direction == "fwd" else self.bwd_codec
        return "none" if x.numel() * x.element_size() < self.min_bytes else codec

    def all_reduce(self, x, direction, async_op=False):
        """SUM over the TP group, in place, returning x (async_op: a handle to wait() on).
        THE single entry point for TP all-reduces."""
        return taco.all_reduce(
            x,
            group=self.group,
            codec=self.codec_for(x, direction),
            codec_block=self.codec_block,
            chunks=self.chunks,
            stats=self.stats,
            async_op=async_op,
            transport=self.transport,
        )

    def reduce_scatter_seq(self, x, direction):
        """(B, T, C) partial sums -> this rank's summed sequence slice (B, T/tp, C)."""
        B, T, C = x.shape
        flat = x.transpose(0, 1).contiguous().view(-1)  # (T, B, C): slices are contiguous
        out = taco.reduce_scatter(
            flat,
            group=self.group,
            codec=self.codec_for(x, direction),
            codec_block=self.codec_block,
            stats=self.stats,
            transport=self.transport,
        )
        return out.view(T // self.size, B, C).transpose(0, 1).contiguous()

    def all_gather_seq(self, x, direction):
        """(B, T/tp, C) sequence slices -> the whole (B, T, C), every rank the same bits."""
        B, t, C = x.shape
        flat = x.transpose(0, 1).contiguous().view(-1)
        out = taco.all_gather(
            flat,
            group=self.group,
            codec=self.codec_for(x, direction),
            codec_block=self.codec_block,
            stats=self.stats,
            transport=self.transport,
        )
        return out.view(t * self.size, B, C).transpose(0, 1).contiguous()


def f(x, weight, bias, comm, sections=None):
    """f, then the column-parallel matmul it precedes: x A^T + b on this rank's output slice (weight
    None: f alone, for a layer that does its own matmul, the fused LM head and loss). sections: sizes of
    A's row blocks, for one output tensor each (SwiGLU's gate and up), whose gradients backward reads apart."""
    if comm.size > 1:
        return _F.apply(x, weight, bias, comm, sections) if weight is not None else _FAlone.apply(x, comm)
    if weight is None or sections is None:
        return x if weight is None else F.linear(x, weight, bias)
    # a matmul each, on slices of A (its split would make the compiled backward keep A's bf16 halves, not cast again)
    rows = [slice(sum(sections[:i]), sum(sections[: i + 1])) for i in range(len(sections))]
    return tuple(F.linear(x, weight[r], None if bias is None else bias[r]) for r in rows)


def g(x, comm):
    """g: the sum of the row-parallel partial outputs over the TP group."""
    return x if comm.size == 1 else _G.apply(x, comm)


class _F(torch.autograd.Function):
    """f (Megatron Eq. 3, Fig. 3a) fused with the column-parallel matmul after it: y = x A^T + b.
    forward: identity on x (sequence parallelism: all-gather the sequence slices), the matmul.
    backward: grad_x = grad_y A is a partial sum on every rank: START its all-reduce, compute
    grad_A and grad_b while it is on the wire, wait, return (Megatron-LM's overlapped grad-input
    all-reduce; sequence parallelism: reduce-scatter grad_x back to the slices).
    x arrives in the compute dtype (model.autocast_input); A and b are cast to it, as autocast would."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, sections):
        if comm.sp:
            x = comm.all_gather_seq(x, "fwd")  # (B, T/tp, C) -> (B, T, C)
        w = weight.to(x.dtype)
        b = None if bias is None else bias.to(x.dtype)
        ctx.save_for_backward(x, weight)  # not w, an alias of weight when no cast is needed: compile refuses to save it
        ctx.comm = comm
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.sections = sections
        y = F.linear(x, w, b)
        return y if sections is None else y.split(sections, dim=-1)  # split: backward gets the sections' gradients

    @staticmethod
    def backward(ctx, *gys):  # one gradient per section
        x, weight = ctx.saved_tensors
        comm = ctx.comm
        ws = weight.to(x.dtype).split(ctx.sections or weight.shape[0])  # A cast again, sectioned
        gys = [gy.flatten(0, -2) for gy in gys]  # (tokens, out) each
        gx = sum((gy @ wi for gy, wi in zip(gys[1:], ws[1:])), start=gys[0] @ ws[0]).view(x.shape)  # a partial sum
        if not comm.sp:
            handle = comm.all_reduce(gx, "bwd", async_op=True)  # start f's all-reduce ...
        gw = [gy.t() @ x.flatten(0, -2) for gy in gys]  # ... these matmuls run meanwhile
        gw = (torch.cat(gw) if len(gw) > 1 else gw[0]).to(ctx.dtypes[0])
        gb = None if ctx.dtypes[1] is None else torch.cat([gy.sum(0) for gy in gys]).to(ctx.dtypes[1])
        if not comm.sp:
            handle.wait()  # gx is the full sum from here on
        else:
            gx = comm.reduce_scatter_seq(gx, "bwd")  # (B, T, C) -> (B, T/tp, C)
        return gx, gw, gb, None, None


class _FAlone(torch.autograd.Function):
    """f without a matmul after it: identity forward (sequence parallelism: all-gather), the sum of the
    partial input gradients over TP backward (sequence parallelism: reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.all_gather_seq(x, "fwd") if comm.sp else x.view_as(x)

    @staticmethod
    def backward(ctx, gx):
        if ctx.comm.sp:
            return ctx.comm.reduce_scatter_seq(gx.contiguous(), "bwd"), None
        return ctx.comm.all_reduce(gx.contiguous(), "bwd"), None


class _G(torch.autograd.Function):
    """g (Megatron Fig. 3b): all-reduce forward (summing the row-parallel partial outputs),
    identity backward. Sequence parallelism: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        if not comm.sp:
            return comm.all_reduce(x.contiguous(), "fwd")
        return comm.reduce_scatter_seq(x, "fwd")  # (B, T, C) -> (B, T/tp, C)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.comm.sp:
            return grad, None
        return ctx.comm.all_gather_seq(grad.contiguous(), "bwd"), None


def sync_replicated_grads(params, comm):
    """Complete the gradients that are partial sums over TP although their parameter is replicated on
    every TP rank: the q/k norms of a Qwen3 block (each rank's gradient comes from its own heads:
    tp_partial_grad), and with sequence parallelism every replicated parameter outside the TP blocks
    (norms, biases added after the reduce-scatter, positions: each rank saw its slice of the tokens)."""
    if comm.size == 1:
        return
    for p in params:
        partial = getattr(p, "tp_partial_grad", False) or (comm.sp and not getattr(p, "tp_split", False))
        if p.grad is not None and partial:
            dist.all_reduce(p.grad, group=comm.group)


# -----------------------------------------------------------------------------
# pipeline parallelism


def pipeline_schedule(kind, microbatches, stage, stages):
    """The order in which one stage runs the forward ("fwd") and backward ("bwd") of each microbatch.
    gpipe: all forwards, then all backwards; a stage holds all n microbatches' activations.
    1f1b (PipeDream-flush, Narayanan et al. 2021): stages - stage - 1 warm-up forwards, then one
    forward / one backward in turn, then the remaining backwards; at most stages - stage in flight.
    Both run the backwards in microbatch order, so gradients accumulate in the same order.
    (check_layout refuses other kinds.)"""
    n = microbatches
    if kind == "gpipe":
        return [("fwd", i) for i in range(n)] + [("bwd", i) for i in range(n)]
    warm = min(stages - stage - 1, n)
    acts = [("fwd", i) for i in range(warm)]
    for i in range(warm, n):
        acts += [("fwd", i), ("bwd", i - warm)]
    return acts + [("bwd", i) for i in range(n - warm, n)]


def send_stage(t, dst, codec, stats=None):
    """Start sending t to global rank dst, compressed by codec (a taco codec object): returns
    (work, buffer); the buffer must stay alive until work.wait()."""
    t = t.detach().contiguous()
    buf = t if codec is taco.IDENTITY else codec.compress(t)
    if stats is not None:
        stats.add(buf.numel() * buf.element_size(), t.numel() * t.element_size())
    return dist.isend(buf, dst), buf


def recv_stage(shape, dtype, device, src, codec):
    """Receive what send_stage sent (the receiver knows the shape, so it knows the message size)."""
    if codec is taco.IDENTITY:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src)
        return t
    n = math.prod(shape)
    buf = torch.empty(codec.nbytes(codec.padded(n)), dtype=torch.uint8, device=device)
    dist.recv(buf, src)
    return codec.decompress(buf, shape, dtype)


def run_pipeline(
    actions,
    forward,
    grid,
    shape,
    dtype,
    device,
    verbose=False,
    codec="none",
    codec_bwd=None,
    codec_block=256,
    stats=None,
):
    """Run one stage's part of a pipeline step. forward(i, hidden) -> (out, loss) runs microbatch i
    on this stage (loss on the last stage, already divided by the number of microbatches).
    Activations go to the next stage (global rank + tp) and gradients back (rank - tp) with
    asynchronous sends and blocking receives; messages between two stages arrive in the order sent,
    which both schedules respect. Returns the summed loss on the last stage, else None.

    codec / codec_bwd compress the activations / the gradients between stages (TAH-Quant-style:
    `tahquant` (lab/tahquant.py) forward, a higher-precision codec such as `hint8` backward). The
    TP ranks of a stage hold the same activation and encode it identically, so they stay in step."""
    first, last = grid.pp_rank == 0, grid.pp_rank == grid.pp - 1
    prev, nxt = grid.rank - grid.tp, grid.rank + grid.tp
    cd_f = taco.get_codec(codec, codec_block)
    cd_b = taco.get_codec(codec if codec_bwd is None else codec_bwd, codec_block)
    inputs, outputs = {}, {}  # microbatch -> this stage's input and output, kept for its backward
    sends = []  # (work, buffer) of every send in flight
    total = None  # the summed loss (last stage)

    def trace(msg):
        if verbose:
            print(f"[rank {grid.rank} stage {grid.pp_rank}] {msg}", flush=True)

    for kind, i in actions:
        if kind == "fwd":
            h = None
            if not first:
                h = recv_stage(shape, dtype, device, prev, cd_f)
                trace(f"F{i}: received activation from rank {prev}")
                h.requires_grad_(torch.is_grad_enabled())
            out, loss = forward(i, h)
            if last:
                total = loss.detach() if total is None else total + loss.detach()
            else:
                sends.append(send_stage(out, nxt, cd_f, stats))  # keeps the buffer alive
                trace(f"F{i}: sent activation to rank {nxt}")
            if torch.is_grad_enabled():
                inputs[i], outputs[i] = h, (loss if last else out)
        else:
            y = outputs.pop(i)  # freed once its backward has run
            if last:
                y.backward()
            else:
                g = recv_stage(y.shape, y.dtype, device, nxt, cd_b)
                trace(f"B{i}: received gradient from rank {nxt}")
                y.backward(g)
            h = inputs.pop(i)
            if not first:
                sends.append(send_stage(h.grad, prev, cd_b, stats))
                trace(f"B{i}: sent gradient to rank {prev}")
    for work, _ in sends:
        work.wait()
    return total


def sync_tied_grads(model, grid):
    """Sum the tied embedding's gradient over its two copies (first and last stage)."""
    if (
        grid.pp > 1
        and model.config.tie_embeddings
        and (model.first or model.last)
        and model.wte.weight.grad is not None
    ):
        dist.all_reduce(model.wte.weight.grad, group=grid.tied_group)
