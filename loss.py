"""
An appendix of the book: the LM head and the cross-entropy fused and chunked, vocab-parallel. model.py's LMHead.loss
calls fused_linear_cross_entropy; nothing here is on the route of a TP all-reduce. It exists for memory and speed: the
plain way, logits = h A^T then F.cross_entropy, keeps a (tokens, V/tp) tensor of logits and another of their
gradient, the largest tensors of a step.

The idea is Liger's and Apple's Cut Cross-Entropy, vocab-parallel as Megatron's loss; the gradients are made by hand in
the forward, while each chunk's logits exist, and handed to autograd by HandMadeGrads. Two custom ops write in place
where the compiler would otherwise make a copy (softmax_grad_) or could not lower the GEMM (accumulate_mm).
"""

import torch
import torch.distributed as dist


def fused_linear_cross_entropy(h, weight, targets, comm, n_real, chunk, grads):
    """The LM head and the mean cross-entropy in one, chunk by chunk of tokens, so that no (tokens, V)
    tensor ever exists whole. h: (N, C), weight: (V/tp, C), targets: (N,) (-1: ignored), n_real: the real
    columns of the padded vocabulary, chunk: tokens per chunk (0: all at once). For a chunk's logits z = h A^T
    on this rank's columns (vocabulary padding at -inf):

        loss   = sum over valid tokens of (log sum_j exp z_j - z_target) / n_valid
        dz     = (softmax(z) - onehot(target)) * valid / n_valid
        grad_h = dz A   (a partial sum over TP ranks: f's all-reduce completes it)      grad_A = dz^T h

    Each rank reduces its own columns to a max m_r and S_r = sum exp(z - m_r) and the target's logit
    (0 on the ranks that do not own it); two per-token all-reduces over TP, tiny and exact (so no
    codec), combine them: M = max m_r, then sum exp over the vocabulary = sum S_r exp(m_r - M) and the
    target's logit. The loss is the last thing a step computes, so its gradients are made here, in
    forward, while each chunk's logits exist (no second pass over the head), with autograd off (else a
    compiled region also makes, unused, what its own backward would save); HandMadeGrads hands them to
    backward, which scales them by the incoming gradient (1/micro-batches). grads=False (evaluation):
    the loss alone.

    A chunk's two halves, before and after the all-reduces, are compiled on their own (nested compile
    regions, and ops of their own where they write in place): nothing fuses across chunks, so one chunk's
    logits are live at a time (left to itself, the compiler fuses every chunk's gradient pass into one, after
    all chunks' logits exist). Its partitioner keeps for the backward whichever is fewer bytes: grad_A in
    fp32, or the chunks' dz (bf16: when a step has fewer tokens than twice the width C), from which the
    backward then forms grad_A."""
    with torch.no_grad():
        w = weight.to(h.dtype)
        N = h.shape[0]
        n_real = max(0, min(n_real - comm.rank * w.shape[0], w.shape[0]))  # this rank's real columns
        valid = targets >= 0
        n_valid = valid.sum().clamp(min=1)
        local = targets - comm.rank * w.shape[0]  # the target's column here
        mine = (local >= 0) & (local < n_real)
        local = local.masked_fill(~mine, 0)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if grads else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if grads else None
        for a in range(0, N, chunk or N):
            b = min(a + (chunk or N), N)
            z, m, sum_exp, target = _chunk_stats(h[a:b], w, n_real, local[a:b], mine[a:b])
            if comm.size > 1:
                m_all = m.clone()
                dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=comm.group)
                stats = torch.stack((sum_exp * (m - m_all).exp(), target))
                dist.all_reduce(stats, group=comm.group)  # sum of exp over the vocabulary, target logit
                m, sum_exp, target = m_all, stats[0], stats[1]
            lse = m + sum_exp.log()  # log sum_j exp z_j
            total += ((lse - target) * valid[a:b]).sum()
            if grads:
                s = valid[a:b] / n_valid
                one = (s * mine[a:b])[:, None]  # the one-hot's weight: 0 where another rank owns the target
                dz = z  # from here dz's softmax part, written over the logits, which are not needed after
                torch.ops.nanotaco.softmax_grad_(dz, lse, s)
                grad_h[a:b] = _chunk_grad_h(dz, one, local[a:b], w)
                torch.ops.nanotaco.accumulate_mm(grad_w, dz.t(), h[a:b])  # grad_w (V/tp, C) += dz^T h
                grad_w.index_add_(0, local[a:b], -one * h[a:b].float())  # the one-hot's part: rows of h
        loss = total / n_valid
    return HandMadeGrads.apply(loss, h, weight, grad_h, grad_w.to(weight.dtype)) if grads else loss


class HandMadeGrads(torch.autograd.Function):
    """loss, whose gradients with respect to h and weight were made by hand (grad_h, grad_w): backward
    hands them on, scaled by the incoming gradient."""

    @staticmethod
    def forward(ctx, loss, h, weight, grad_h, grad_w):
        ctx.save_for_backward(grad_h, grad_w)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        return None, grad_h * grad.to(grad_h.dtype), grad_w * grad, None, None


# a function the compiler compiles on its own and never fuses with its neighbours (torch >= 2.8; before, a plain call)
nested_compile_region = getattr(torch.compiler, "nested_compile_region", lambda fn: fn)


@nested_compile_region
def _chunk_stats(h, w, n_real, local, mine):
    """A chunk's logits z (n, V/tp) in h's dtype, padding at -inf, and per token this rank's max m,
    sum exp(z - m) and target logit. m is clamped from below to the lowest finite float so that a rank
    whose columns are all padding gives sum 0, not exp(-inf + inf) = NaN; a NaN in z still propagates."""
    z = h @ w.t()
    if n_real < w.shape[0]:
        z[:, n_real:] = -torch.inf  # the vocabulary's padding
    m = z.max(dim=-1).values.float().clamp(min=torch.finfo(torch.float32).min)
    sum_exp = (z.float() - m[:, None]).exp().sum(dim=-1)
    return z, m, sum_exp, torch.where(mine, z.gather(1, local[:, None])[:, 0].float(), 0.0)


@torch.library.custom_op("nanotaco::softmax_grad_", mutates_args=("z",))
def softmax_grad_(z: torch.Tensor, lse: torch.Tensor, s: torch.Tensor) -> None:
    """z := dz's softmax part, exp(z - lse) s, in z's dtype, in place, so that one (n, V/tp) tensor is live,
    not two. An op of its own: the compiler writes a nested region's result to a new tensor, and loses
    an in-place write to a region's input; on a GPU it runs a compiled function of its own, which reads
    and writes z in one pass (eager, a pass per op, through an fp32 copy)."""
    (_softmax_grad_compiled if z.is_cuda else _softmax_grad)(z, lse, s)


def _softmax_grad(z, lse, s):
    z.copy_(((z.float() - lse[:, None]).exp() * s[:, None]).to(z.dtype))


_softmax_grad_compiled = torch.compile(_softmax_grad)


@nested_compile_region
def _chunk_grad_h(dz, one, local, w):
    """A chunk's share of grad_h, dz A: its softmax part's product, less the one-hot's part, a row of A
    (one: the one-hot's weight, 0 where another rank owns the target)."""
    return dz @ w - one * w[local]


@torch.library.custom_op("nanotaco::accumulate_mm", mutates_args=("acc",))
def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc in fp32, a and b in fp32 or bf16. On a GPU one GEMM adds into acc as it writes
    (cuBLAS's beta = 1), not a bf16 product and then a pass over acc; an op of its own because the compiler
    cannot lower addmm's out_dtype (torch 2.13), which has no CPU kernel."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)
