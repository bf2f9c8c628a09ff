"""
GPT-2 and Qwen2 (the Llama shape) in one file, with hand-written tensor parallelism (Megatron-LM,
Shoeybi et al. 2019). Per transformer block, with tp ranks:

    x ─ LN ─ f ─ QKV (column ‖) ─ attention on n_head/tp local heads ─ out-proj (row ‖) ─ g ─ + x
    x ─ LN ─ f ─ fc  (column ‖) ─ GELU on 4C/tp local features   ─ proj   (row ‖) ─ g ─ + x

Qwen2 (Hugging Face's Qwen2ForCausalLM; config.arch chooses) swaps parts in that skeleton: RMSNorm
for LN; rotary positions on q and k for learned positions; grouped-query attention (n_head/n_kv_head
query heads read each key/value head; QKV biased, out-proj not); SwiGLU, proj(silu(gate) * up) with
fc = [gate|up], for the GELU MLP; the LM head tied to the embedding or a weight of its own.

f and g are parallel.py's two operators: f is the identity forward and all-reduces the input
gradient backward (it runs inside ColumnParallelLinear, fused with its matmul), g all-reduces the
row-parallel partial sums forward. Their all-reduces are the ones taco.py compresses. The token
embedding and the tied LM head are split over the vocabulary, and the loss is a vocab-parallel
cross-entropy: full logits are never gathered. Built in a plain process (no TPComm given) the model
is TP=1. Every weight is drawn at full size from the seed and then sliced: TP=1 and TP=N start alike.
"""

import math
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

import parallel

ARCHS = ("gpt2", "qwen2")


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257  # real vocabulary; the embedding is padded to a multiple of 128
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # gpt2: every linear and LayerNorm; qwen2: the QKV projection's
    arch: str = "gpt2"  # ARCHS
    n_kv_head: int = 0  # qwen2: key/value heads (0: n_head)
    intermediate_size: int = 0  # qwen2: SwiGLU width (0: 4 * n_embd)
    rope_theta: float = 10000.0  # qwen2: rotary base
    norm_eps: float = 1e-5  # epsilon of LayerNorm / RMSNorm
    tie_embeddings: bool = True  # the LM head's weight is the token embedding's

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        self.intermediate_size = self.intermediate_size or 4 * self.n_embd

    @classmethod
    def from_settings(cls, c):
        """The model's shape from a run's settings (train.py's names, a subset of them suffices)."""
        return cls(**{f.name: c[f.name] for f in fields(cls) if f.name in c})

    padded_vocab = property(lambda self: -(-self.vocab_size // 128) * 128)  # rows of the embedding

    def num_params(self, non_embedding=True):
        """Parameters of the whole model (unsharded); non_embedding leaves out the lookups that are no
        matmul (GPT-2's positions, an untied token embedding)."""
        C, b, gpt2, qkv, I = (
            self.n_embd,
            int(self.bias),
            self.arch == "gpt2",
            sum(self.qkv_sections),
            self.intermediate_size,
        )
        nrm = C + b * C if gpt2 else C  # LayerNorm (+ bias) or RMSNorm
        block = C * qkv + C * C + (3 - gpt2) * I * C + b * qkv + 2 * nrm + (b * (2 * C + I) if gpt2 else 0)
        lookup = self.block_size * C if gpt2 else 0 if self.tie_embeddings else self.padded_vocab * C
        n = (2 - self.tie_embeddings) * self.padded_vocab * C + gpt2 * self.block_size * C + self.n_layer * block + nrm
        return n - (lookup if non_embedding else 0)

    @property
    def qkv_sections(self):  # the fused QKV's output sections [Q | K | V]
        return tuple(n * (self.n_embd // self.n_head) for n in (self.n_head, self.n_kv_head, self.n_kv_head))


# -----------------------------------------------------------------------------
# tensor-parallel layers


def autocast_input(x):
    """Under autocast, cast before f, so that its backward all-reduce carries bf16 gradients (the
    matmul would cast anyway; LayerNorm's output is fp32 under autocast)."""
    return x.to(torch.get_autocast_dtype(x.device.type)) if torch.is_autocast_enabled(x.device.type) else x


class ColumnParallelLinear(nn.Module):
    """Y = f(X) A^T + b with A split by output rows; each rank owns out/tp outputs. No
    communication in forward; f all-reduces the input gradient in backward.

        A = [ A_0 ]   rank 0 computes X A_0^T  (B, T, out/tp)
            [ A_1 ]   rank 1 computes X A_1^T
    `sections` (sizes summing to d_out) splits the output first (QKV: [Q|K|V], SwiGLU: [gate|up])
    and gives each rank its slice of every section, so rank r owns whole heads of Q, K and V."""

    def __init__(self, d_in, d_out, comm, bias=True, sections=None):
        super().__init__()
        self.comm, self.sections = comm, tuple(sections or (d_out,))
        self.weight = nn.Parameter(torch.empty(d_out // comm.size, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out // comm.size)) if bias else None
        self.weight.tp_split = True
        if bias:
            self.bias.tp_split = True

    def shard(self, full):  # full: (d_out, ...) -> this rank's rows
        parts = full.split(self.sections, dim=0)
        return torch.cat([s.chunk(self.comm.size, dim=0)[self.comm.rank] for s in parts], dim=0)

    def forward(self, x):  # x: (B, T, in), sequence parallelism: (B, T/tp, in)
        return parallel.f(autocast_input(x), self.weight, self.bias, self.comm)  # (B, T, out/tp)


class RowParallelLinear(nn.Module):
    """Y = g(X A^T) + b with A split by input columns; the input arrives already split (the
    output of a column-parallel layer), each rank computes a partial sum, g all-reduces it.

        A = [ A_0 | A_1 ]   Y = X_0 A_0^T + X_1 A_1^T   (the sum is the TP all-reduce)
    The bias is added once, after the reduction."""

    def __init__(self, d_in, d_out, comm, bias=True):
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(d_out, d_in // comm.size))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        self.weight.tp_split = True

    def shard(self, full):  # full: (d_out, d_in) -> this rank's columns
        return full.chunk(self.comm.size, dim=1)[self.comm.rank]

    def forward(self, x):  # x: (B, T, in/tp)
        y = parallel.g(F.linear(x, self.weight), self.comm)  # (B, T, out), SP: (B, T/tp, out)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r owns rows [r*V/tp, (r+1)*V/tp) of the (padded) token embedding; tokens outside
    the range look up zeros, and g sums the ranks' partial embeddings."""

    def __init__(self, vocab, dim, comm):
        super().__init__()
        self.comm = comm
        self.per_rank = vocab // comm.size
        self.start = comm.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim))
        self.weight.tp_split = True

    def shard(self, full):
        return full.chunk(self.comm.size, dim=0)[self.comm.rank]

    @staticmethod
    def lookup(idx, weight, start):
        """This shard's partial embedding: rows of tokens in [start, start + len(weight)), else 0."""
        local = idx - start
        outside = (local < 0) | (local >= weight.shape[0])
        return F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[..., None], 0.0)

    def forward(self, idx):
        if self.comm.size == 1:
            return F.embedding(idx, self.weight)
        return parallel.g(self.lookup(idx, self.weight, self.start), self.comm, "embed")  # (B, T, C), SP: (B, T/tp, C)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from logits split over the vocabulary (Megatron's vocab-parallel loss).
    Three per-token all-reduces over TP (max, sum of exp, target logit) replace gathering the
    (N, V) logits. They are tiny and exact, so they bypass the codecs. Columns >= n_real (vocabulary
    padding) are excluded; targets == -1 are ignored. Works in place on one (N, V/tp) buffer."""

    @staticmethod
    def forward(ctx, logits, targets, start, n_real, group):  # logits: (N, V/tp) fp32, targets: (N,)
        tp = dist.get_world_size(group) if group is not None else 1
        n_real = max(0, min(n_real, logits.shape[-1]))
        m = logits[:, :n_real].max(dim=-1).values if n_real else logits.new_full(logits.shape[:1], -torch.inf)
        if tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        local = targets - start
        mine = (local >= 0) & (local < n_real)
        local = local.masked_fill(~mine, 0)
        p = logits - m[:, None]  # (N, V/tp), the one big buffer
        zt = p.gather(1, local[:, None])[:, 0] * mine
        p[:, n_real:] = -torch.inf
        se = p.exp_().sum(dim=-1)
        if tp > 1:
            both = torch.stack((zt, se))
            dist.all_reduce(both, group=group)
            zt, se = both[0], both[1]
        valid = targets >= 0
        nvalid = valid.sum().clamp(min=1)
        loss = ((se.log() - zt) * valid).sum() / nvalid
        ctx.save_for_backward(p.div_(se[:, None]), local, mine & valid, valid, nvalid)  # p = softmax
        return loss

    @staticmethod
    def backward(ctx, grad):
        p, local, hit, valid, nvalid = ctx.saved_tensors
        g = p.mul_(valid[:, None])  # reuses the softmax buffer
        g[torch.arange(g.shape[0], device=g.device), local] -= hit.to(g.dtype)
        return g.mul_(grad / nvalid), None, None, None, None


# -----------------------------------------------------------------------------
# the transformer


class RMSNorm(nn.Module):
    """Qwen2's RMSNorm in Hugging Face's order: normalise in fp32, cast back, then the weight."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotary(T, head_dim, theta, device):
    """cos, sin (T, head_dim) in fp32 of Hugging Face's half-split rotary embedding: dimension i and
    i + head_dim/2 of a head form one pair, rotated by the angle pos * theta^(-2i/head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = (torch.arange(T, device=device).float()[:, None] * inv_freq).repeat(1, 2)  # (T, head_dim)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):  # x: (B, h, T, hd); cos, sin cast to x's dtype (as HF)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head (GPT-2) or grouped-query (Qwen2: n_kv_head < n_head, rotary on q and k) attention
    on this rank's heads: n_head/tp query heads and the n_kv_head/tp key/value heads they read."""

    def __init__(self, cfg, comm):
        super().__init__()
        self.hd, self.gqa = cfg.n_embd // cfg.n_head, cfg.n_kv_head != cfg.n_head
        self.local = [n // comm.size for n in cfg.qkv_sections]  # this rank's [Q|K|V]: whole heads
        self.qkv = ColumnParallelLinear(cfg.n_embd, sum(cfg.qkv_sections), comm, cfg.bias, sections=cfg.qkv_sections)
        self.proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, comm, cfg.bias and cfg.arch == "gpt2")
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x, rope=None):  # x: (B, T, C), with sequence parallelism (B, T/tp, C)
        q, k, v = (
            rearrange(t, "b t (h d) -> b h t d", d=self.hd)  # (B, h/tp or kv/tp, T, hd)
            for t in self.qkv(x).split(self.local, dim=-1)
        )  # (B, T, (h + 2kv) hd/tp)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0, enable_gqa=self.gqa
        )  # (B, h/tp, T, hd)
        return self.resid_drop(self.proj(rearrange(y, "b h t d -> b t (h d)")))  # (B, T, C/tp) -> (B, T, C)


class MLP(nn.Module):
    """GPT-2: proj(GELU(fc(x))); Qwen2's SwiGLU: proj(silu(gate) * up) with fc = [gate|up]."""

    def __init__(self, cfg, comm):
        super().__init__()
        self.swiglu, I = cfg.arch == "qwen2", cfg.intermediate_size
        bias, sections = cfg.bias and not self.swiglu, (I, I) if self.swiglu else (I,)
        self.fc = ColumnParallelLinear(cfg.n_embd, sum(sections), comm, bias, sections=sections)
        self.proj = RowParallelLinear(I, cfg.n_embd, comm, bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        h = self.fc(x)  # (B, T, I/tp); SwiGLU: (B, T, 2I/tp)
        h = F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1] if self.swiglu else F.gelu(h, approximate="tanh")
        return self.drop(self.proj(h))  # (B, T, I/tp) -> (B, T, C)


def norm(cfg):
    return (
        RMSNorm(cfg.n_embd, cfg.norm_eps)
        if cfg.arch == "qwen2"
        else nn.LayerNorm(cfg.n_embd, cfg.norm_eps, bias=cfg.bias)
    )


class Block(nn.Module):
    def __init__(self, cfg, comm):
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg, comm.at("attn"))
        self.ln_2 = norm(cfg)
        self.mlp = MLP(cfg, comm.at("mlp"))

    def forward(self, x, rope=None):
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The whole model (stages=1) or one pipeline stage of it: stage s of S owns blocks [s*L/S,
    (s+1)*L/S); the first stage also owns the embeddings, the last the final norm and the LM head,
    a column-parallel linear. Tied, its weight IS the token embedding's: with S > 1 the last stage
    holds a copy of wte whose gradient is summed with the first stage's every step
    (parallel.sync_tied_grads), so the two stay equal; untied, it is the last stage's own weight."""

    def __init__(self, config, comm=None, seed=0, stage=0, stages=1):
        super().__init__()
        self.config = c = config
        self.comm = comm or parallel.TPComm()
        self.stage, self.stages = stage, stages
        self.first, self.last = stage == 0, stage == stages - 1
        per = c.n_layer // stages
        self.layers = range(stage * per, (stage + 1) * per)  # global indices of this stage's blocks
        if self.first or (self.last and c.tie_embeddings):
            self.wte = VocabParallelEmbedding(c.padded_vocab, c.n_embd, self.comm)
            self.wte.weight.pp_tied_copy = not self.first  # counted once in the gradient norm
        if self.first:
            self.wpe = nn.Embedding(c.block_size, c.n_embd) if c.arch == "gpt2" else None  # qwen2: rotary
            self.drop = nn.Dropout(c.dropout)
        self.h = nn.ModuleList([Block(c, self.comm) for _ in self.layers])
        if self.last:
            self.ln_f = norm(c)
            self.lm_head = ColumnParallelLinear(c.n_embd, c.padded_vocab, self.comm, bias=False)
            if c.tie_embeddings:
                self.lm_head.weight = self.wte.weight  # tied: one parameter, sliced alike
        if seed is not None:  # None: weights to be loaded
            self.init_weights(seed)

    # --- initialisation: full tensors from one generator, then this rank's slice ---
    def full_shapes(self):
        """(module or None if another stage owns it, attribute, full shape, std) for every weight of
        the whole model, in a fixed order: the same on every rank, TP degree and pipeline stage."""
        c = self.config
        proj_std = 0.02 / math.sqrt(2 * c.n_layer)  # GPT-2: scale residual projections
        owned = dict(zip(self.layers, self.h))
        C, I = c.n_embd, c.intermediate_size
        yield getattr(self, "wte", None), "weight", (c.padded_vocab, C), 0.02
        if c.arch == "gpt2":
            yield getattr(self, "wpe", None), "weight", (c.block_size, C), 0.02
        for i in range(c.n_layer):
            b = owned.get(i)
            yield b and b.attn.qkv, "weight", (sum(c.qkv_sections), C), 0.02
            yield b and b.attn.proj, "weight", (C, C), proj_std
            yield b and b.mlp.fc, "weight", ((2 if c.arch == "qwen2" else 1) * I, C), 0.02
            yield b and b.mlp.proj, "weight", (C, I), proj_std
        if not c.tie_embeddings:
            yield getattr(self, "lm_head", None), "weight", (c.padded_vocab, C), 0.02

    @torch.no_grad()
    def init_weights(self, seed):
        gen = torch.Generator().manual_seed(seed)
        for mod, attr, shape, std in self.full_shapes():
            full = torch.randn(shape, generator=gen) * std  # drawn even if not ours
            if mod is not None:
                getattr(mod, attr).copy_(mod.shard(full) if hasattr(mod, "shard") else full)
        for m in self.modules():  # biases zero, norm weights one
            if isinstance(getattr(m, "bias", None), torch.Tensor):
                m.bias.zero_()
            if isinstance(m, (nn.LayerNorm, RMSNorm)):
                m.weight.fill_(1.0)

    # --- forward ---
    def forward(self, idx, targets=None, hidden=None):
        """idx: (B, T) token ids (first stage), hidden: (B, T, C) from the previous stage (others).
        Returns (logits, loss) on the last stage: logits are this rank's vocabulary slice
        (B, T, V_padded/tp), all positions with targets, the last position only without.
        Other stages return (hidden state for the next stage, None)."""
        c, sp = self.config, self.comm.size if self.comm.sp else 1
        if self.first:
            B, T = idx.shape
            assert T <= c.block_size, f"sequence length {T} > block_size {c.block_size}"
            assert T % sp == 0, f"sequence parallelism needs T ({T}) divisible by tp"
            x = self.wte(idx)  # (B, T, C), SP: (B, T/tp, C)
            pos = torch.arange(T, device=idx.device).chunk(sp)[self.comm.rank if sp > 1 else 0]  # SP: its slice
            x = self.drop(x + self.wpe(pos) if self.wpe is not None else x)
        else:
            x = hidden
        rope = rotary(x.shape[1] * sp, c.n_embd // c.n_head, c.rope_theta, x.device) if c.arch == "qwen2" else None
        for block in self.h:
            x = block(x, rope)
        if not self.last:
            return x, None
        if targets is None:  # generation: the last position only
            assert not self.comm.sp, "the last position alone: not with sequence parallelism"
            return self.lm_head(self.ln_f(x)[:, -1:, :]), None  # (B, 1, V/tp)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V/tp)
        if self.comm.size == 1:  # the whole vocabulary here: PyTorch's loss, fused by torch.compile (unlike a slice)
            real = logits.float().masked_fill(
                torch.arange(logits.shape[-1], device=x.device) >= c.vocab_size, -torch.inf
            )
            return logits, F.cross_entropy(real.flatten(0, 1), targets.flatten(), ignore_index=-1)  # padding: -inf
        start = self.comm.rank * logits.shape[-1]  # this rank's first column
        loss = VocabParallelCrossEntropy.apply(
            logits.float().view(-1, logits.shape[-1]), targets.view(-1), start, c.vocab_size - start, self.comm.group
        )  # padding excluded
        return logits, loss
