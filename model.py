"""
A GPT-2 in one file, with hand-written tensor parallelism (Megatron-LM, Shoeybi et al. 2019).

Per transformer block, with tp ranks:

    x ─ LN ─ f ─ QKV (column ‖) ─ attention on n_head/tp local heads ─ out-proj (row ‖) ─ g ─ + x
    x ─ LN ─ f ─ fc  (column ‖) ─ GELU on 4C/tp local features   ─ proj   (row ‖) ─ g ─ + x

f and g are parallel.py's two operators: f is the identity forward and all-reduces the input
gradient backward (it runs inside ColumnParallelLinear, fused with its matmul), g all-reduces the
row-parallel partial sums forward. Their all-reduces are the ones taco.py compresses. The token
embedding and the tied LM head are split over the vocabulary, and the loss is a vocab-parallel
cross-entropy: full logits are never gathered.

Built in a plain process (no TPComm given) the model is TP=1 and is an ordinary GPT-2.
Every weight is initialised at full size from the seed and then sliced, so TP=1 and TP=N start
from identical parameters.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import parallel


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257      # real vocabulary; the embedding is padded to a multiple of 128
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True

    @property
    def padded_vocab(self):
        return -(-self.vocab_size // 128) * 128


# -----------------------------------------------------------------------------
# tensor-parallel layers

def autocast_input(x):
    """Under autocast, cast before f, so that its backward all-reduce carries bf16 gradients (the
    matmul would cast anyway; LayerNorm's output is fp32 under autocast)."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


class ColumnParallelLinear(nn.Module):
    """Y = f(X) A^T + b with A split by output rows; each rank owns out/tp outputs. No
    communication in forward; f all-reduces the input gradient in backward.

        A = [ A_0 ]   rank 0 computes X A_0^T  (B, T, out/tp)
            [ A_1 ]   rank 1 computes X A_1^T
    `parts` > 1 splits the output into that many equal sections first (QKV: [Q|K|V]) and gives
    each rank the same slice of every section, so rank r owns whole heads of Q, K and V."""

    def __init__(self, d_in, d_out, comm, bias=True, parts=1):
        super().__init__()
        self.comm, self.parts = comm, parts
        self.weight = nn.Parameter(torch.empty(d_out // comm.size, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out // comm.size)) if bias else None
        self.weight.tp_split = True
        if bias:
            self.bias.tp_split = True

    def shard(self, full):                       # full: (d_out, ...) -> this rank's rows
        sections = full.chunk(self.parts, dim=0)
        return torch.cat([s.chunk(self.comm.size, dim=0)[self.comm.rank] for s in sections], dim=0)

    def forward(self, x):                        # x: (B, T, in), sequence parallelism: (B, T/tp, in)
        return parallel.f(autocast_input(x), self.weight, self.bias, self.comm)       # (B, T, out/tp)


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

    def shard(self, full):                       # full: (d_out, d_in) -> this rank's columns
        return full.chunk(self.comm.size, dim=1)[self.comm.rank]

    def forward(self, x):                        # x: (B, T, in/tp)
        y = parallel.g(F.linear(x, self.weight), self.comm)          # (B, T, out), SP: (B, T/tp, out)
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
        return parallel.g(self.lookup(idx, self.weight, self.start), self.comm, "embed")   # (B, T, C), SP: (B, T/tp, C)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from logits split over the vocabulary (Megatron's vocab-parallel loss).
    Three per-token all-reduces over TP (max, sum of exp, target logit) replace gathering the
    (N, V) logits. They are tiny and exact, so they bypass the codecs. Columns >= n_real (vocabulary
    padding) are excluded; targets == -1 are ignored. Works in place on one (N, V/tp) buffer."""

    @staticmethod
    def forward(ctx, logits, targets, start, n_real, group):   # logits: (N, V/tp) fp32, targets: (N,)
        tp = dist.get_world_size(group) if group is not None else 1
        n_real = max(0, min(n_real, logits.shape[-1]))
        m = logits[:, :n_real].max(dim=-1).values if n_real else logits.new_full(logits.shape[:1], -torch.inf)
        if tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        local = targets - start
        mine = (local >= 0) & (local < n_real)
        local = local.masked_fill(~mine, 0)
        p = logits - m[:, None]                                   # (N, V/tp), the one big buffer
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
        ctx.save_for_backward(p.div_(se[:, None]), local, mine & valid, valid, nvalid)   # p = softmax
        return loss

    @staticmethod
    def backward(ctx, grad):
        p, local, hit, valid, nvalid = ctx.saved_tensors
        g = p.mul_(valid[:, None])                                # reuses the softmax buffer
        g[torch.arange(g.shape[0], device=g.device), local] -= hit.to(g.dtype)
        return g.mul_(grad / nvalid), None, None, None, None


# -----------------------------------------------------------------------------
# the transformer

class CausalSelfAttention(nn.Module):
    def __init__(self, cfg, comm):
        super().__init__()
        self.n_head = cfg.n_head // comm.size        # local heads
        self.qkv = ColumnParallelLinear(cfg.n_embd, 3 * cfg.n_embd, comm, cfg.bias, parts=3)
        self.proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, comm, cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x):                        # x: (B, T, C), with sequence parallelism (B, T/tp, C)
        qkv = self.qkv(x)                                                          # (B, T, 3C/tp) = [Q|K|V]
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in qkv.chunk(3, dim=2))   # (B, h/tp, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, -1)))     # (B, T, C/tp) -> (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg, comm):
        super().__init__()
        self.fc = ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, comm, cfg.bias)
        self.proj = RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, comm, cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))   # GPT-2 GELU; (B, T, 4C/tp) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg, comm):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, comm.at("attn"))
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg, comm.at("mlp"))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The whole GPT (stages=1) or one pipeline stage of it: stage s of S owns blocks
    [s*L/S, (s+1)*L/S); the first stage also owns the embeddings, the last the final LayerNorm and
    the LM head. The head is a column-parallel linear whose weight IS the token embedding's (tied):
    with S > 1 the last stage holds a copy of wte whose gradient is summed with the first stage's
    every step (parallel.sync_tied_grads), so the two stay equal."""

    def __init__(self, config, comm=None, seed=0, stage=0, stages=1):
        super().__init__()
        self.config = config
        self.comm = comm or parallel.TPComm()
        c = config
        self.stage, self.stages = stage, stages
        self.first, self.last = stage == 0, stage == stages - 1
        per = c.n_layer // stages
        self.layers = range(stage * per, (stage + 1) * per)       # global indices of this stage's blocks
        if self.first or self.last:
            self.wte = VocabParallelEmbedding(c.padded_vocab, c.n_embd, self.comm)
            self.wte.weight.pp_tied_copy = not self.first       # counted once in the gradient norm
        if self.first:
            self.wpe = nn.Embedding(c.block_size, c.n_embd)
            self.drop = nn.Dropout(c.dropout)
        self.h = nn.ModuleList([Block(c, self.comm) for _ in self.layers])
        if self.last:
            self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
            self.lm_head = ColumnParallelLinear(c.n_embd, c.padded_vocab, self.comm, bias=False)
            self.lm_head.weight = self.wte.weight               # tied: one parameter, sliced alike
        self.init_weights(seed)

    # --- initialisation: full tensors from one generator, then this rank's slice ---
    def full_shapes(self):
        """(module or None if another stage owns it, attribute, full shape, std) for every weight of
        the whole model, in a fixed order: the same on every rank, TP degree and pipeline stage."""
        c = self.config
        proj_std = 0.02 / math.sqrt(2 * c.n_layer)   # GPT-2: scale residual projections
        owned = dict(zip(self.layers, self.h))
        yield getattr(self, "wte", None), "weight", (c.padded_vocab, c.n_embd), 0.02
        yield getattr(self, "wpe", None), "weight", (c.block_size, c.n_embd), 0.02
        for i in range(c.n_layer):
            b = owned.get(i)
            yield b and b.attn.qkv, "weight", (3 * c.n_embd, c.n_embd), 0.02
            yield b and b.attn.proj, "weight", (c.n_embd, c.n_embd), proj_std
            yield b and b.mlp.fc, "weight", (4 * c.n_embd, c.n_embd), 0.02
            yield b and b.mlp.proj, "weight", (c.n_embd, 4 * c.n_embd), proj_std

    @torch.no_grad()
    def init_weights(self, seed):
        gen = torch.Generator().manual_seed(seed)
        for mod, attr, shape, std in self.full_shapes():
            full = torch.randn(shape, generator=gen) * std             # drawn even if not ours
            if mod is not None:
                getattr(mod, attr).copy_(mod.shard(full) if hasattr(mod, "shard") else full)
        for m in self.modules():                 # biases zero, LayerNorm weight one
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.bias is not None:
                m.bias.zero_()
            if isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
                if m.bias is not None:
                    m.bias.zero_()

    def num_params(self, non_embedding=True):
        """Parameters of the whole model (all stages, unsharded), from the config."""
        c, C, b = self.config, self.config.n_embd, int(self.config.bias)
        per_layer = 12 * C * C + b * 9 * C + 2 * (C + b * C)        # 4 linears (+ biases), 2 LayerNorms
        n = c.padded_vocab * C + c.block_size * C + c.n_layer * per_layer + (C + b * C)
        return n - (c.block_size * C if non_embedding else 0)

    # --- forward ---
    def forward(self, idx, targets=None, hidden=None):
        """idx: (B, T) token ids (first stage), hidden: (B, T, C) from the previous stage (others).
        Returns (logits, loss) on the last stage: logits are this rank's vocabulary slice
        (B, T, V_padded/tp), all positions with targets, the last position only without.
        Other stages return (hidden state for the next stage, None)."""
        if self.first:
            B, T = idx.shape
            assert T <= self.config.block_size, f"sequence length {T} > block_size {self.config.block_size}"
            pos = torch.arange(T, device=idx.device)
            if self.comm.sp:                         # this rank's slice of the sequence
                assert T % self.comm.size == 0, f"sequence parallelism needs T ({T}) divisible by tp"
                pos = pos.chunk(self.comm.size)[self.comm.rank]
            x = self.drop(self.wte(idx) + self.wpe(pos))                             # (B, T, C), SP: (B, T/tp, C)
        else:
            x = hidden
        for block in self.h:
            x = block(x)
        if not self.last:
            return x, None
        if targets is None:                                      # generation: the last position only
            assert not self.comm.sp, "the last position alone: not with sequence parallelism"
            return self.lm_head(self.ln_f(x)[:, -1:, :]), None                     # (B, 1, V/tp)
        logits = self.lm_head(self.ln_f(x))                                          # (B, T, V/tp)
        n_real = self.config.vocab_size - self.wte.start                          # padding columns excluded
        loss = VocabParallelCrossEntropy.apply(logits.float().view(-1, logits.shape[-1]), targets.view(-1),
                                               self.wte.start, n_real, self.comm.group)
        return logits, loss
