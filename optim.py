"""
An appendix of the book: the optimizer a step ends with, AdamW with weight decay on the 2-D weights, taking the
gradient clip's coefficient (train.clip_grad_norm makes it) in its step. train.py's build_optimizer picks one through
adamw(); nothing here is on the route of a TP all-reduce.

Clipping scales every gradient by coef = min(1, max_norm / norm). Done first, as torch.nn.utils.clip_grad_norm_
does it, that is one more pass over every gradient before AdamW's own pass; here the step applies it as it reads
them: ClipAdamW's compiled pass multiplies each gradient by coef (a GPU with compile on), fused AdamW divides by its
grad_scale (a GPU without compile), and only the plain AdamW of a CPU scales the gradients first.
"""

import math

import torch


def param_groups(params, weight_decay):
    """AdamW's two groups: weight decay on the 2-D weights only (not on norms, biases)."""
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def adamw(params, lr, betas, weight_decay, use_cuda, compiled):
    """The AdamW a run steps: ClipAdamW on a GPU with compile on, else torch's (fused on a GPU)."""
    groups = param_groups(params, weight_decay)
    if use_cuda and compiled:
        return ClipAdamW(groups, lr=lr, betas=betas)
    return AdamW(groups, lr=lr, betas=betas, fused=use_cuda)


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step takes the clip's coefficient (None: no clipping). Fused, it divides each gradient
    by its grad_scale as it reads it (the gradients are left divided); else the gradients are scaled first."""

    @torch.no_grad()
    def step(self, coef=None):
        if coef is not None and self.defaults.get("fused"):
            self.grad_scale = coef.reciprocal()
        elif coef is not None:
            torch._foreach_mul_([p.grad for g in self.param_groups for p in g["params"] if p.grad is not None], coef)
        return super().step()


@torch.compile(fullgraph=True)
def adamw_(ps, grads, ms, vs, coef, s, beta1, beta2, eps):
    """torch.optim.AdamW's update of one parameter group in place, each gradient read times the clip's coef;
    s = [1 - lr * weight_decay, -lr / (1 - beta1^t), sqrt(1 - beta2^t)], a tensor, so that a new lr or step
    compiles nothing. Compiled, one pass reads p, grad, m, v and writes p, m, v: the least a clipped AdamW can
    move (fused AdamW, clipping by its grad_scale, also writes every gradient back, divided)."""
    g = torch._foreach_mul(grads, coef)
    torch._foreach_mul_(ps, s[0])  # decoupled weight decay
    torch._foreach_lerp_(ms, g, 1 - beta1)  # m = beta1 m + (1 - beta1) g
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, g, g, 1 - beta2)  # v = beta2 v + (1 - beta2) g^2
    denom = torch._foreach_add_(torch._foreach_div_(torch._foreach_sqrt(vs), s[2]), eps)
    torch._foreach_addcdiv_(ps, torch._foreach_mul(ms, s[1]), denom)  # p -= lr m_hat / (sqrt(v_hat) + eps)


class ClipAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (its groups, state and checkpoints) whose step runs adamw_ with the clip's coefficient
    (None: 1): on a GPU with compile on, one compiled pass per group instead of fused AdamW's pass and its
    write-back."""

    @torch.no_grad()
    def step(self, coef=None):
        coef = 1.0 if coef is None else coef
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if not ps:
                continue
            state = [self.state[p] for p in ps]
            for p, st in zip(ps, state):
                if not st:
                    st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                st["step"] += 1  # on the CPU, as torch's own AdamW keeps it
            b1, b2 = group["betas"]
            t = state[0]["step"].item()
            lr = group["lr"]
            s = [1 - lr * group["weight_decay"], -lr / (1 - b1**t), math.sqrt(1 - b2**t)]
            s = torch.tensor(s).to(ps[0].device, non_blocking=True)  # no sync: the host never waits on the GPU
            ms = [st["exp_avg"] for st in state]
            vs = [st["exp_avg_sq"] for st in state]
            adamw_(ps, [p.grad for p in ps], ms, vs, coef, s, b1, b2, group["eps"])
