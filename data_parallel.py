"""
Data parallelism: every DP rank trains the same model on other micro-batches, and the gradients are
averaged over the DP group, in flat buckets started during the backward pass (DPGradSync), or the
optimizer is sharded over the group (ZeroAdamW, ZeRO stage 1). Both can send their bytes through
taco's compressed collectives (SDP4Bit-style, arXiv 2410.15526).
"""

import math

import torch
import torch.distributed as dist

import taco


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

    def __init__(
        self, params, group, world, bucket_numel=2**24, codec="none", codec_block=256, stats=None, overlap=True
    ):
        self.group, self.world, self.codec, self.codec_block, self.stats = group, world, codec, codec_block, stats
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
        self.micro = 0  # 0: not in a step, hooks do nothing

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
            taco.all_reduce(flat, group=self.group, codec=self.codec, codec_block=self.codec_block, stats=self.stats)
        self.pending[b] = (work, flat, grads)

    def finish(self):
        for b in range(len(self.buckets)):  # buckets not started yet (overlap=False: all of them)
            if b not in self.pending:
                self._launch(b)
        for work, flat, grads in self.pending.values():
            if work is not None:
                work.wait()
            flat /= self.world
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))
        self.micro = 0


class ZeroAdamW:
    """ZeRO stage 1 (Rajbhandari et al. 2020): AdamW whose state — fp32 master weights and both
    moments — is sharded over the DP group, so each DP rank holds 1/dp of it.

    The model's parameters (this TP/PP rank's shard of them) are viewed as ONE flat fp32 vector,
    zero-padded to dp equal slices of S elements (S a multiple of the codec block); DP rank d owns
    slice d. A step:
        1. reduce-scatter the flat gradient over DP (taco.reduce_scatter: compressed by grad_codec),
           divide by dp: each rank holds the averaged gradient of its slice only;
        2. the caller clips with the global norm (reduce_grads returns this slice's squares);
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

    def __init__(
        self,
        params,
        grid,
        lr,
        betas,
        eps,
        weight_decay,
        grad_codec="none",
        param_codec="none",
        codec_block=256,
        stats=None,
    ):
        self.params, self.group, self.W, self.rank = params, grid.dp_group, grid.dp, grid.dp_rank
        self.lr, (self.b1, self.b2), self.eps = lr, betas, eps
        self.grad_codec, self.param_codec, self.codec_block, self.stats = grad_codec, param_codec, codec_block, stats
        self.N = sum(p.numel() for p in params)
        self.S = taco.cdiv(taco.cdiv(self.N, self.W), codec_block) * codec_block
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
        out[: self.N] = torch.cat([t.reshape(-1).float() for t in tensors])
        return out

    def reduce_grads(self):
        """Step 1; frees the parameters' .grad. Returns this rank's (squares of TP-split
        gradients, squares of replicated ones), summed over the DP group."""
        flat = self.flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        for p in self.params:
            p.grad = None
        self.grad = (
            taco.reduce_scatter(
                flat, group=self.group, codec=self.grad_codec, codec_block=self.codec_block, stats=self.stats
            )
            / self.W
        )
        g2 = self.grad.square()
        sq = torch.stack((torch.where(self.split, g2, 0).sum(), torch.where(self.repl, g2, 0).sum()))
        dist.all_reduce(sq, group=self.group)
        return sq[0], sq[1]

    @torch.no_grad()
    def step(self, lr, coef=None):
        """Steps 3-4 with the clipping coefficient coef (None: no clipping)."""
        g = self.grad if coef is None else self.grad * coef
        self.t += 1
        self.master.mul_(torch.where(self.decay, 1 - lr * self.weight_decay, 1.0))
        self.m.lerp_(g, 1 - self.b1)
        self.v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
        denom = (self.v.sqrt() / math.sqrt(1 - self.b2**self.t)).add_(self.eps)
        self.master.addcdiv_(self.m, denom, value=-lr / (1 - self.b1**self.t))
        if self.param_codec in ("", "none"):
            full = taco.all_gather(self.master, group=self.group, codec="none", stats=self.stats)
        else:
            diff = self.master - self.flat([p.detach() for p in self.params])[self.own]
            full = taco.all_gather(
                diff, group=self.group, codec=self.param_codec, codec_block=self.codec_block, stats=self.stats
            )
        o = 0
        for p in self.params:  # new values, or values + decoded differences
            piece = full[o : o + p.numel()].view_as(p).to(p.dtype)
            p.copy_(piece) if self.param_codec in ("", "none") else p.add_(piece)
            o += p.numel()
        self.grad = None

    def state_dict(self):
        return {"master": self.master, "m": self.m, "v": self.v, "t": self.t, "dp": [self.W, self.rank]}

    def load_state_dict(self, sd):
        if sd["dp"] != [self.W, self.rank]:
            raise ValueError(
                f"ZeRO checkpoint of dp rank {sd['dp'][1]} of {sd['dp'][0]} loaded by {self.rank} of {self.W}"
            )
        self.master.copy_(sd["master"]), self.m.copy_(sd["m"]), self.v.copy_(sd["v"])
        self.t = sd["t"]
