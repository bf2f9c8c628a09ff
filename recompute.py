"""
An appendix of the book: what the backward makes again instead of the forward keeping it (torch.utils.checkpoint),
for memory. model.py calls it where a policy acts (GPTConfig.recompute: POLICIES), and for every weight's bf16 copy
under autocast (autocast_weight), which is always made again. Nothing here is on the route of a TP all-reduce, and
nothing here changes a result: only what is kept between the forward and the backward, and what is computed twice.
"""

import torch
from torch.utils.checkpoint import checkpoint

# "pointwise": the norms' outputs and the MLP's activation, cheap elementwise passes that torch.compile keeps by
# default because a matmul of the backward reads them; "mlp": each MLP's fc and activation (its widest tensors; no
# all-reduce runs again, but sequence parallelism's all-gather before fc does); "block": every block whole (least
# memory; under TP its all-reduces run again)
POLICIES = ("", "pointwise", "mlp", "block")


def again(fn, *args):
    """fn(*args), of which the forward keeps only args: the backward runs fn again for what it needs."""
    return checkpoint(fn, *args, use_reentrant=False)


def autocast_weight(w):
    """Under autocast, the weight's bf16 copy, which the input gradient's matmul reads in the backward. The cast is
    marked for recomputation, so the compiled backward makes it again from the fp32 parameter (resident anyway)
    instead of keeping it from the forward: 2 bytes a parameter less at the peak, one more cast a step. Eager,
    the matmul itself keeps the copy, as it did."""
    if not (torch.is_autocast_enabled(w.device.type) and torch.is_grad_enabled()):
        return w
    return again(lambda t: t.to(torch.get_autocast_dtype(t.device.type)), w)


def mlp_hidden(mlp, x, policy):
    """model.MLP's activation act(fc(x)) under a policy. mlp: the forward keeps x (B, T, C) instead of fc's output
    (B, T, 2I/tp with SwiGLU) and what the activation saves, proj still keeps the result; pointwise: it keeps fc's
    output, and proj's weight gradient reads the activation made again; otherwise as the model computes it."""
    if policy == "mlp":
        return again(mlp.up, x)
    if policy == "pointwise":
        return again(mlp.act, mlp.fc(x))
    return mlp.up(x)
