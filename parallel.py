"""
Process groups and the communication that tensor parallelism needs.

The rank grid (Megatron convention, tensor-parallel varying fastest):

    ranks = torch.arange(world).view(dp, pp, tp)

so the tp ranks of one model replica are neighbours (same node, fastest link). Every rank belongs
to one TP group (a row of the grid), one PP group and one DP group.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, Section 3) needs two conjugate operators:

    f = copy_to_tp      forward: identity          backward: all-reduce   (before a column-parallel layer)
    g = reduce_from_tp  forward: all-reduce        backward: identity     (after a row-parallel layer)

Both go through ONE function, `TPComm.all_reduce`, which is the place where `taco.py` compresses
the traffic (TACO paper, Fig. 2: the forward g and the backward f carry activations and activation
gradients of size B*T*C, which is what TACO compresses).

With sequence parallelism (Korthikanti et al. 2022) the activations between the TP blocks are
sharded along the sequence, f becomes an all-gather and g a reduce-scatter (the two halves of the
all-reduce), both through taco.all_gather / taco.reduce_scatter, so they are compressed too.

TP emulation (`TPComm.emulate = t` on a single rank) makes every TP all-reduce numerically what a
TP=t group would send and receive: the partial sums are formed as t ranks would form them and
combined by taco.emulated_all_reduce. One GPU can so study TP=8 compression.

Pipeline parallelism splits the blocks over pp stages and runs microbatches through them with a
GPipe or 1F1B schedule (point-to-point sends of the (B, T, C) activations and their gradients).
Data parallelism averages gradients over the DP group in flat buckets, started during the backward
pass (DPGradSync), or shards the optimizer over it (ZeroAdamW, ZeRO stage 1).
"""
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

import taco


class ConfigError(ValueError):
    """A configuration that cannot work; raised before any work starts, names the fix."""


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
    local_rank: int = 0
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    tied_group: object = None     # first and last pipeline stage of this (dp, tp) position (tied wte)


def check_layout(tp, pp, dp, world, n_head=None, n_embd=None, vocab_size=None, n_layer=None):
    """Refuse layouts that cannot work, with a message naming the fix. Pure function (testable)."""
    for name, v in (("tp", tp), ("pp", pp), ("dp", dp)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")
    if tp * pp * dp != world:
        raise ConfigError(f"tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} but the world size is {world}: "
                          f"launch with torchrun --nproc_per_node={tp * pp * dp} or change tp/pp/dp")
    if n_layer is not None and n_layer % pp:
        raise ConfigError(f"n_layer={n_layer} is not divisible by pp={pp}: every pipeline stage gets the "
                          f"same number of blocks; pick pp from the divisors of n_layer")
    if n_head is not None and n_head % tp:
        raise ConfigError(f"n_head={n_head} is not divisible by tp={tp}: each TP rank must own whole "
                          f"attention heads; pick tp from the divisors of n_head")
    if n_embd is not None and n_embd % tp:
        raise ConfigError(f"n_embd={n_embd} is not divisible by tp={tp}")
    if n_embd is not None and n_head is not None and n_embd % n_head:
        raise ConfigError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
    if vocab_size is not None and vocab_size % tp:
        raise ConfigError(f"the padded vocabulary ({vocab_size}) is not divisible by tp={tp}; "
                          f"use a power-of-two tp (the vocabulary is padded to a multiple of 128)")


def init_grid(tp=1, pp=1, dp=None, backend=None):
    """Read torchrun's environment, init the default process group and build the TP/PP/DP groups.
    Without torchrun (no WORLD_SIZE) this is a single process and no group is created."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // (tp * pp) if dp is None else dp
    check_layout(tp, pp, dp, world)
    if world == 1 and not dist.is_initialized():
        return Grid(tp=tp, pp=pp, dp=dp)
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend=backend)
    rank = dist.get_rank()
    grid = Grid(rank=rank, world=world, tp=tp, pp=pp, dp=dp,
                local_rank=int(os.environ.get("LOCAL_RANK", rank)))
    ranks = torch.arange(world).view(dp, pp, tp)
    # every rank must create every group, in the same order (torch.distributed's rule)
    for d in range(dp):
        for p in range(pp):
            g = dist.new_group(ranks[d, p, :].tolist())
            if rank in ranks[d, p, :].tolist():
                grid.tp_group = g
    for d in range(dp):
        for t in range(tp):
            g = dist.new_group(ranks[d, :, t].tolist())
            if rank in ranks[d, :, t].tolist():
                grid.pp_group = g
    for p in range(pp):
        for t in range(tp):
            g = dist.new_group(ranks[:, p, t].tolist())
            if rank in ranks[:, p, t].tolist():
                grid.dp_group = g
    if pp > 1:
        for d in range(dp):
            for t in range(tp):
                ends = [ranks[d, 0, t].item(), ranks[d, pp - 1, t].item()]
                g = dist.new_group(ends)
                if rank in ends:
                    grid.tied_group = g
    (grid.dp_rank,), (grid.pp_rank,), (grid.tp_rank,) = [
        x.tolist() for x in (ranks == rank).nonzero(as_tuple=True)]
    return grid


# -----------------------------------------------------------------------------
# the one TP all-reduce, and the f / g operators built on it

@dataclass
class TPComm:
    """Everything a tensor-parallel layer needs to talk to its TP peers.

    fwd_codec compresses the forward all-reduce (g: activations after a row-parallel layer);
    bwd_codec the backward one (f: activation gradients before a column-parallel layer).
    "none" is a plain torch.distributed.all_reduce."""
    group: object = None
    size: int = 1
    rank: int = 0
    fwd_codec: str = "none"
    bwd_codec: str = "none"
    block_size: int = 256
    chunks: int = 1
    min_bytes: int = taco.DEFAULT_MIN_BYTES
    stats: taco.CommStats = field(default_factory=taco.CommStats)
    capture: list = None         # if a list: (direction, copy of x) of every call is appended
    emulate: int = 1             # > 1 (with size 1): compute as a TP=emulate group would (see below)
    sp: bool = False             # sequence parallelism: activations outside the TP blocks are (B, T/tp, C)
    transport: str = "auto"      # taco.symm_workspace: auto | dist (NCCL, gloo) | symm (symmetric memory)

    def codec_for(self, x, direction):
        """The codec a real TP all-reduce of x would use (min_bytes applies, as in taco.all_reduce)."""
        codec = self.fwd_codec if direction == "fwd" else self.bwd_codec
        return "none" if x.numel() * x.element_size() < self.min_bytes else codec

    def all_reduce(self, x, direction, async_op=False):
        """SUM over the TP group, in place, returning x (async_op: a handle to wait() on).
        THE single entry point for TP all-reduces."""
        if self.size == 1:
            return taco.all_reduce(x, async_op=async_op) if async_op else x     # a no-op handle
        if self.capture is not None:
            self.capture.append((direction, x.detach().clone()))
        codec = self.fwd_codec if direction == "fwd" else self.bwd_codec
        return taco.all_reduce(x, group=self.group, codec=codec, block_size=self.block_size,
                               chunks=self.chunks, min_bytes=self.min_bytes, stats=self.stats, async_op=async_op,
                               transport=self.transport)


    def reduce_scatter_seq(self, x, direction):
        """(B, T, C) partial sums -> this rank's summed sequence slice (B, T/tp, C)."""
        B, T, C = x.shape
        flat = x.transpose(0, 1).contiguous().view(-1)            # (T, B, C): slices are contiguous
        out = taco.reduce_scatter(flat, group=self.group, codec=self.codec_for(x, direction),
                                  block_size=self.block_size, stats=self.stats, transport=self.transport)
        return out.view(T // self.size, B, C).transpose(0, 1).contiguous()

    def all_gather_seq(self, x, direction):
        """(B, T/tp, C) sequence slices -> the whole (B, T, C), every rank the same bits."""
        B, t, C = x.shape
        flat = x.transpose(0, 1).contiguous().view(-1)
        out = taco.all_gather(flat, group=self.group, codec=self.codec_for(x, direction),
                              block_size=self.block_size, stats=self.stats, transport=self.transport)
        return out.view(t * self.size, B, C).transpose(0, 1).contiguous()


def tp_comm_from_grid(grid, **kw):
    return TPComm(group=grid.tp_group, size=grid.tp, rank=grid.tp_rank, **kw)


class CopyToTP(torch.autograd.Function):
    """f (Megatron Eq. 3 / Fig. 3a): identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad.contiguous(), "bwd"), None


class ColumnParallelLinearFn(torch.autograd.Function):
    """f fused with the column-parallel matmul, so that f's backward all-reduce overlaps with the
    weight gradient (Megatron-LM's async grad-input all-reduce): y = x W^T + b, with x the
    (replicated) input; backward: grad_x = grad_y W, START its all-reduce, compute grad_W and
    grad_b while it is on the wire, wait, return. x arrives already in the compute dtype
    (model.autocast_input); W and b are cast to it, as autocast would."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        w = weight.to(x.dtype)
        b = None if bias is None else bias.to(x.dtype)
        ctx.save_for_backward(x, w)
        ctx.comm, ctx.dtypes = comm, (weight.dtype, None if bias is None else bias.dtype)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx = gy @ w                                                     # (..., in): a partial sum
        handle = ctx.comm.all_reduce(gx, "bwd", async_op=True)         # start f's all-reduce ...
        gy2 = gy.reshape(-1, gy.shape[-1])
        gw = (gy2.t() @ x.reshape(-1, x.shape[-1])).to(ctx.dtypes[0])  # ... these matmuls run meanwhile
        gb = None if ctx.dtypes[1] is None else gy2.sum(0).to(ctx.dtypes[1])
        handle.wait()                                                   # gx is the full sum from here on
        return gx, gw, gb, None


class ReduceFromTP(torch.autograd.Function):
    """g (Megatron Fig. 3b): all-reduce forward (summing row-parallel partial outputs), identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x.contiguous(), "fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSeq(torch.autograd.Function):
    """Sequence-parallel f (Korthikanti et al. 2022): all-gather the sequence slices before a
    column-parallel layer; the backward reduce-scatters the input gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.all_gather_seq(x, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.reduce_scatter_seq(grad, "bwd"), None


class ScatterToSeq(torch.autograd.Function):
    """Sequence-parallel g: reduce-scatter the row-parallel partial sums into sequence slices (the
    all-reduce's first half); the backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.reduce_scatter_seq(x, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather_seq(grad.contiguous(), "bwd"), None


def enter_tp(x, comm):
    """Before a column-parallel layer: f, or with sequence parallelism its all-gather."""
    return GatherFromSeq.apply(x, comm) if comm.sp and comm.size > 1 else copy_to_tp(x, comm)


def leave_tp(x, comm):
    """After a row-parallel layer (or the vocab-parallel embedding): g, or SP's reduce-scatter."""
    return ScatterToSeq.apply(x, comm) if comm.sp and comm.size > 1 else reduce_from_tp(x, comm)


def sync_sp_grads(params, comm):
    """With sequence parallelism each TP rank sees only its slice of the tokens in LayerNorms,
    biases added after the reduce-scatter and position embeddings: sum their gradients over TP."""
    if comm.sp and comm.size > 1:
        for p in params:
            if p.grad is not None and not getattr(p, "tp_split", False):
                dist.all_reduce(p.grad, group=comm.group)


def copy_to_tp(x, comm):
    return x if comm.size == 1 else CopyToTP.apply(x, comm)


def reduce_from_tp(x, comm):
    return x if comm.size == 1 else ReduceFromTP.apply(x, comm)


# -----------------------------------------------------------------------------
# TP emulation: one process computes what a TP=t group would, all-reduces included

def column_rows(d_out, parts, t):
    """The output rows each of t ranks owns in a column-parallel layer: every one of `parts`
    equal sections (QKV: [Q|K|V]) cut into t pieces, rank r taking piece r of each."""
    sec = d_out // parts
    per = sec // t
    return [torch.cat([torch.arange(p * sec + r * per, p * sec + (r + 1) * per) for p in range(parts)])
            for r in range(t)]


class EmulatedReduceFromTP(torch.autograd.Function):
    """g, emulated: t partial outputs combined exactly as taco.all_reduce combines t ranks'
    contributions (taco.emulated_all_reduce); backward hands every partial the same gradient."""

    @staticmethod
    def forward(ctx, comm, *partials):
        ctx.t = len(partials)
        parts = [p.contiguous() for p in partials]
        return taco.emulated_all_reduce(parts, codec=comm.codec_for(parts[0], "fwd"), block_size=comm.block_size)

    @staticmethod
    def backward(ctx, grad):
        return (None,) + (grad,) * ctx.t


class EmulatedColumnLinear(torch.autograd.Function):
    """y = x W^T + b with every product shaped as on t ranks (rank r: the rows it owns), so the
    numbers match a real TP=t run; in backward the input gradient is formed as the t ranks form it
    (grad_y[..., rows_r] @ W[rows_r]) and combined like f's all-reduce."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, parts):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.rows = column_rows(weight.shape[0], parts, comm.emulate)
        outs = [F.linear(x, weight[r], None if bias is None else bias[r]) for r in ctx.rows]
        y = x.new_empty(*x.shape[:-1], weight.shape[0], dtype=outs[0].dtype)
        for r, o in zip(ctx.rows, outs):
            y[..., r] = o
        return y

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        comm, wd = ctx.comm, w.to(gy.dtype)
        gys = [gy[..., r].contiguous() for r in ctx.rows]
        partials = [g @ wd[r] for g, r in zip(gys, ctx.rows)]
        gx = taco.emulated_all_reduce(partials, codec=comm.codec_for(partials[0], "bwd"), block_size=comm.block_size)
        x2 = x.reshape(-1, x.shape[-1]).to(gy.dtype)
        gw, gb = torch.empty_like(w), torch.empty(w.shape[0], dtype=w.dtype, device=w.device) if ctx.has_bias else None
        for g, r in zip(gys, ctx.rows):
            g2 = g.reshape(-1, g.shape[-1])
            gw[r] = (g2.t() @ x2).to(w.dtype)
            if ctx.has_bias:
                gb[r] = g2.sum(0).to(w.dtype)
        return gx.to(x.dtype), gw, gb, None, None


# -----------------------------------------------------------------------------
# pipeline parallelism

def pipeline_schedule(kind, microbatches, stage, stages):
    """The order in which one stage runs the forward (F) and backward (B) of each microbatch.
    gpipe: all forwards, then all backwards; a stage holds all M microbatches' activations.
    1f1b (PipeDream-flush, Narayanan et al. 2021): stages - stage - 1 warm-up forwards, then one
    forward / one backward in turn, then the remaining backwards; at most stages - stage in flight.
    Both run the backwards in microbatch order, so gradients accumulate in the same order."""
    M = microbatches
    if kind == "gpipe":
        return [("F", i) for i in range(M)] + [("B", i) for i in range(M)]
    if kind != "1f1b":
        raise ConfigError(f"schedule={kind!r}: choose gpipe or 1f1b")
    warm = min(stages - stage - 1, M)
    acts = [("F", i) for i in range(warm)]
    for i in range(warm, M):
        acts += [("F", i), ("B", i - warm)]
    return acts + [("B", i) for i in range(M - warm, M)]


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


def run_pipeline(actions, forward, grid, shape, dtype, device, verbose=False,
                 codec="none", codec_bwd=None, block_size=256, stats=None):
    """Run one stage's part of a pipeline step. forward(i, hidden) -> (out, loss) runs microbatch i
    on this stage (loss on the last stage, already divided by the number of microbatches).
    Activations go to the next stage (global rank + tp) and gradients back (rank - tp) with
    asynchronous sends and blocking receives; messages between two stages arrive in the order sent,
    which both schedules respect. Returns the summed loss on the last stage, else None.

    codec / codec_bwd compress the activations / the gradients between stages (TAH-Quant-style:
    `tahquant` forward, a higher-precision codec such as `hint8` backward; default: none). The
    TP ranks of a stage hold the same activation and encode it identically, so they stay in step."""
    first, last = grid.pp_rank == 0, grid.pp_rank == grid.pp - 1
    prev, nxt = grid.rank - grid.tp, grid.rank + grid.tp
    cd_f = taco.get_codec(codec, block_size)
    cd_b = taco.get_codec(codec if codec_bwd is None else codec_bwd, block_size)
    inputs, outputs, sends, total = {}, {}, [], None

    def trace(msg):
        if verbose:
            print(f"[rank {grid.rank} stage {grid.pp_rank}] {msg}", flush=True)

    for kind, i in actions:
        if kind == "F":
            h = None
            if not first:
                h = recv_stage(shape, dtype, device, prev, cd_f)
                trace(f"F{i}: received activation from rank {prev}")
                h.requires_grad_(torch.is_grad_enabled())
            out, loss = forward(i, h)
            if last:
                total = loss.detach() if total is None else total + loss.detach()
            else:
                sends.append(send_stage(out, nxt, cd_f, stats))      # keeps the buffer alive
                trace(f"F{i}: sent activation to rank {nxt}")
            if torch.is_grad_enabled():
                inputs[i], outputs[i] = h, (loss if last else out)
        else:
            y = outputs.pop(i)                      # freed once its backward has run
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
    if grid.pp > 1 and (model.first or model.last) and model.wte.weight.grad is not None:
        dist.all_reduce(model.wte.weight.grad, group=grid.tied_group)


# -----------------------------------------------------------------------------
# data parallelism

class DPGradSync:
    """Average gradients over the DP group: flat fp32 buckets, one all-reduce each.

    With a codec (SDP4Bit-style, arXiv 2410.15526: Hadamard-smoothed low-bit gradients; `hint8` or
    `hint4`) each bucket goes through the same two-shot compressed all-reduce as TP traffic. (Of
    SDP4Bit we implement the gradient quantisation with a Hadamard rotation, at one bit width for
    the whole all-reduce, not its two-level intra-/inter-node split; its weight-difference
    all-gather is in ZeroAdamW.)

    overlap=True (PyTorch DDP's idea, in a page): parameters are grouped into buckets in REVERSE
    order (roughly the order in which backward produces their gradients), and a
    post-accumulate-grad hook counts, per parameter, the micro-batch backwards of the step; when
    the last one has accumulated into every parameter of a bucket, the bucket's all-reduce starts
    (async) while backward goes on with earlier layers. With a codec the bucket goes through
    taco.all_reduce (on the GPU its kernels and NCCL calls are queued on streams, so the host
    returns to the backward pass; on gloo it blocks). overlap=False: every bucket in finish().
    finish() waits for all of them and writes the averages back into .grad."""

    def __init__(self, params, group, world, bucket_numel=2 ** 24, codec="none", block_size=256, stats=None,
                 overlap=True):
        self.group, self.world, self.codec, self.block_size, self.stats = group, world, codec, block_size, stats
        self.buckets, self.bucket_of, n = [[]], {}, 0
        for p in reversed(params):
            if self.buckets[-1] and n + p.numel() > bucket_numel:
                self.buckets.append([])
                n = 0
            self.buckets[-1].append(p)
            self.bucket_of[p] = len(self.buckets) - 1
            n += p.numel()
            if overlap:
                p.register_post_accumulate_grad_hook(self._hook)
        self.micro = 0                                      # 0: not in a step, hooks do nothing

    def start(self, micro):
        """Call before the step's backward passes: `micro` micro-batches will accumulate."""
        self.micro, self.count, self.ready, self.pending = micro, {}, [0] * len(self.buckets), {}

    def _hook(self, p):
        if not self.micro:
            return
        c = self.count[p] = self.count.get(p, 0) + 1
        if c == self.micro:
            b = self.bucket_of[p]
            self.ready[b] += 1
            if self.ready[b] == len(self.buckets[b]):
                self._launch(b)

    def _launch(self, b):
        grads = [p.grad for p in self.buckets[b] if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        if self.codec in ("", "none"):
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            if self.stats is not None:
                logical = 2 * (self.world - 1) * flat.numel() * 4 / self.world
                self.stats.add(logical, logical)
        else:
            work = None
            taco.all_reduce(flat, group=self.group, codec=self.codec, block_size=self.block_size, stats=self.stats)
        self.pending[b] = (work, flat, grads)

    def finish(self):
        for b in range(len(self.buckets)):      # buckets not started yet (overlap=False: all of them)
            if b not in self.pending:
                self._launch(b)
        for work, flat, grads in self.pending.values():
            if work is not None:
                work.wait()
            flat /= self.world
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))
        self.micro = 0


def sync_dp_grads(params, group, world, **kw):
    """Average the gradients over the DP group now (after the backward pass): DPGradSync, no hooks."""
    if world > 1:
        sync = DPGradSync(params, group, world, overlap=False, **kw)
        sync.start(1)
        sync.finish()


class ZeroAdamW:
    """ZeRO stage 1 (Rajbhandari et al. 2020): AdamW whose state — fp32 master weights and both
    moments — is sharded over the DP group, so each DP rank holds 1/dp of it.

    The model's parameters (this TP/PP rank's shard of them) are viewed as ONE flat fp32 vector,
    zero-padded to dp equal slices of S elements (S a multiple of the codec block); DP rank d owns
    slice d. A step:
        1. reduce-scatter the flat gradient over DP (taco.reduce_scatter: compressed by grad_codec),
           divide by dp: each rank holds the averaged gradient of its slice only;
        2. the caller clips with the global norm (sq_norms() gives this rank's squares);
        3. AdamW on the slice, exactly torch.optim.AdamW's arithmetic (decoupled weight decay,
           bias-corrected moments), into the exact fp32 master slice;
        4. all-gather the new parameters. With param_codec (SDP4Bit, arXiv 2410.15526: 4-bit
           weight DIFFERENCES), every rank sends codec(master - current parameter) and every rank,
           the owner included, adds the decoded differences to its parameters: all replicas stay
           identical, and the quantisation error of one step is part of the next step's difference
           (it is fed back, not accumulated), because the master stays exact.
    Of SDP4Bit we implement the weight-difference all-gather with one codec (e.g. hint4: Hadamard +
    per-block INT4) and its gradient quantisation through grad_codec; not its two-level
    intra-/inter-node scheme."""

    def __init__(self, params, grid, lr, betas, eps, weight_decay, grad_codec="none", param_codec="none",
                 block_size=256, stats=None):
        self.params, self.group, self.W, self.rank = params, grid.dp_group, grid.dp, grid.dp_rank
        self.lr, (self.b1, self.b2), self.eps = lr, betas, eps
        self.grad_codec, self.param_codec, self.block_size, self.stats = grad_codec, param_codec, block_size, stats
        self.N = sum(p.numel() for p in params)
        self.S = taco.cdiv(taco.cdiv(self.N, self.W), block_size) * block_size
        own = slice(self.rank * self.S, (self.rank + 1) * self.S)
        self.own = own
        self.master = self.flat([p.detach() for p in params])[own].clone()
        self.m, self.v, self.t = torch.zeros_like(self.master), torch.zeros_like(self.master), 0
        # per-element masks for this slice (1 byte each): weight decay (2-D weights, as in train.py's
        # param groups) and the norm bookkeeping of train.clip_grad_norm
        tied = lambda p: getattr(p, "pp_tied_copy", False)
        split = lambda p: getattr(p, "tp_split", False)
        mask = lambda f: self.flat([torch.full_like(p, float(f(p))) for p in params])[own].bool()
        self.weight_decay = weight_decay
        self.decay = mask(lambda p: p.dim() >= 2)
        self.split = mask(lambda p: split(p) and not tied(p))
        self.repl = mask(lambda p: not split(p) and not tied(p))
        self.grad = None

    def flat(self, tensors):
        out = torch.zeros(self.S * self.W, dtype=torch.float32, device=self.params[0].device)
        out[:self.N] = torch.cat([t.reshape(-1).float() for t in tensors])
        return out

    def reduce_grads(self):
        """Step 1; frees the parameters' .grad. Returns this rank's (squares of TP-split
        gradients, squares of replicated ones), summed over the DP group."""
        flat = self.flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        for p in self.params:
            p.grad = None
        self.grad = taco.reduce_scatter(flat, group=self.group, codec=self.grad_codec,
                                        block_size=self.block_size, stats=self.stats) / self.W
        g2 = self.grad.square()
        sq = torch.stack((torch.where(self.split, g2, 0).sum(), torch.where(self.repl, g2, 0).sum()))
        dist.all_reduce(sq, group=self.group)
        return sq[0], sq[1]

    @torch.no_grad()
    def step(self, lr, coef=1.0):
        """Steps 3-4 with the clipping coefficient coef."""
        g = self.grad * coef
        self.t += 1
        self.master.mul_(torch.where(self.decay, 1 - lr * self.weight_decay, 1.0))
        self.m.lerp_(g, 1 - self.b1)
        self.v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
        denom = (self.v.sqrt() / math.sqrt(1 - self.b2 ** self.t)).add_(self.eps)
        self.master.addcdiv_(self.m, denom, value=-lr / (1 - self.b1 ** self.t))
        if self.param_codec in ("", "none"):
            full = taco.all_gather(self.master, group=self.group, codec="none", stats=self.stats)
        else:
            diff = self.master - self.flat([p.detach() for p in self.params])[self.own]
            full = taco.all_gather(diff, group=self.group, codec=self.param_codec,
                                   block_size=self.block_size, stats=self.stats)
        o = 0
        for p in self.params:                               # new values, or values + decoded differences
            piece = full[o:o + p.numel()].view_as(p).to(p.dtype)
            p.copy_(piece) if self.param_codec in ("", "none") else p.add_(piece)
            o += p.numel()
        self.grad = None

    def state_dict(self):
        return {"master": self.master, "m": self.m, "v": self.v, "t": self.t, "dp": [self.W, self.rank]}

    def load_state_dict(self, sd):
        if sd["dp"] != [self.W, self.rank]:
            raise ValueError(f"ZeRO checkpoint of dp rank {sd['dp'][1]} of {sd['dp'][0]} loaded by {self.rank} of {self.W}")
        self.master.copy_(sd["master"]), self.m.copy_(sd["m"]), self.v.copy_(sd["v"])
        self.t = sd["t"]
