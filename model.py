"""
The model families, each a choice of parts in one skeleton, with hand-written tensor parallelism
(Megatron-LM, Shoeybi et al. 2019). Per transformer block, with tp ranks:

    x ─ norm ─ f ─ QKV (column ‖) ─ attention on n_head/tp local heads ─ out-proj (row ‖) ─ g ─ + x
    x ─ norm ─ f ─ fc  (column ‖) ─ activation on I/tp local features   ─ proj   (row ‖) ─ g ─ + x

A family (FAMILIES) names the parts that fill the skeleton: the norm (LayerNorm, or RMSNorm in Hugging
Face's order); the positions (a learned table added to the embedding, or rotary positions on q and k, with
Llama 3's wavelength-banded scaling as an option); the MLP (tanh-GELU, or SwiGLU: proj(silu(gate) * up)
with fc = [gate|up]); which linears carry a bias; an RMSNorm of every query and key head (Qwen3). The
shape beside them: grouped-query attention (n_head/n_kv_head query heads read each key/value head), the
head size, the LM head tied to the embedding or a weight of its own. GPTConfig resolves the family into
parts once; every module below reads parts, never the family's name.

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
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

import parallel
import recompute
from loss import fused_linear_cross_entropy


@dataclass(frozen=True)
class Family:
    """The parts a family's Block is built from (GPTConfig's fields of the same names)."""

    norm: str  # "layernorm" | "rmsnorm"
    positions: str  # "learned": a table added to the token embedding | "rotary": q and k rotated
    mlp: str  # "gelu": proj(GELU(fc x)) | "swiglu": proj(silu(gate x) * up x)
    qkv_bias: bool  # a bias on the q, k and v projections
    linear_bias: bool  # a bias on the other linears: the attention's output projection, the MLP's two
    norm_bias: bool  # LayerNorm's additive bias
    qk_norm: bool  # RMSNorm over each query and key head, before the rotation
    tokenizer: str  # the tokenizer the family's checkpoints read (data/tokenizer.py; not a part of the model)


FAMILIES = {
    "gpt2": Family("layernorm", "learned", "gelu", True, True, True, qk_norm=False, tokenizer="gpt2"),
    "qwen2": Family("rmsnorm", "rotary", "swiglu", True, False, False, qk_norm=False, tokenizer="qwen2"),
    "llama": Family("rmsnorm", "rotary", "swiglu", False, False, False, qk_norm=False, tokenizer="llama3"),
    "qwen3": Family("rmsnorm", "rotary", "swiglu", False, False, False, qk_norm=True, tokenizer="qwen2"),
    # Mistral's tokenizer is not one of data/tokenizer.py's: a run reads the folder's own tokenizer.json
    "mistral": Family("rmsnorm", "rotary", "swiglu", False, False, False, qk_norm=False, tokenizer=""),
}
PARTS = [f.name for f in fields(Family) if f.name != "tokenizer"]
# the values a part of a string type may take (config.py's choices read them)
PART_VALUES = {"norm": ("layernorm", "rmsnorm"), "positions": ("learned", "rotary"), "mlp": ("gelu", "swiglu")}
ROPE_SCALINGS = ("", "llama3")
RECOMPUTE = recompute.POLICIES  # what the backward makes again instead of the forward keeping it (recompute.py)


@dataclass
class GPTConfig:
    family: str = "gpt2"  # a key of FAMILIES: the parts left None below are its
    vocab_size: int = 50257  # real vocabulary; the embedding is padded to a multiple of 128
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = 0  # key/value heads (0: n_head; fewer: grouped-query attention)
    n_embd: int = 768  # the width of the residual stream
    head_dim: int = 0  # the size of a head (0: n_embd / n_head)
    intermediate_size: int = 0  # the MLP's width (0: 4 * n_embd); SwiGLU: each of gate and up
    block_size: int = 1024  # context length T of training; learned positions: the table's rows
    max_positions: int = 0  # rotary: the context the model was made for (0: block_size)
    dropout: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # the rotary base
    rope_scaling: str = ""  # ROPE_SCALINGS: "" or "llama3" (the four settings below)
    rope_factor: float = 8.0  # llama3: long wavelengths' frequencies divided by this
    rope_low_freq: float = 1.0  # llama3: wavelengths above original / low_freq are scaled
    rope_high_freq: float = 4.0  # llama3: wavelengths below original / high_freq are kept
    rope_original_positions: int = 8192  # llama3: the context the frequencies were made for
    tie_embeddings: bool = True  # the LM head's weight is the token embedding's
    loss_chunk: int = 4096  # tokens per chunk of the fused LM head and loss (0: all at once)
    recompute: str = ""  # RECOMPUTE: what the backward recomputes instead of the forward keeping it
    # the parts (Family): None takes the family's
    norm: str = None
    positions: str = None
    mlp: str = None
    qkv_bias: bool = None
    linear_bias: bool = None
    norm_bias: bool = None
    qk_norm: bool = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: choose one of {', '.join(FAMILIES)}")
        for part in PARTS:
            if getattr(self, part) is None:
                setattr(self, part, getattr(FAMILIES[self.family], part))
        self.n_kv_head = self.n_kv_head or self.n_head
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        self.intermediate_size = self.intermediate_size or 4 * self.n_embd
        # learned positions: the context is the table's rows; rotary: the model's own (an export writes it)
        self.max_positions = self.block_size if self.positions == "learned" else self.max_positions or self.block_size

    @classmethod
    def from_settings(cls, s):
        """The model's config from a run's settings (config.Settings, or a dict of them): the fields of
        the same names."""
        get = s.get if isinstance(s, dict) else lambda k, default: getattr(s, k, default)
        return cls(**{f.name: get(f.name, f.default) for f in fields(cls)})

    @property
    def padded_vocab(self):  # rows of the embedding and the LM head: the vocabulary padded to a multiple of 128
        return -(-self.vocab_size // 128) * 128

    @property
    def qkv_sections(self):  # the fused QKV's output sections [Q | K | V]
        return tuple(n * self.head_dim for n in (self.n_head, self.n_kv_head, self.n_kv_head))

    @property
    def fc_sections(self):  # the MLP's fc output sections: SwiGLU's [gate | up], each of the MLP's width, or one
        width = self.intermediate_size
        return (width, width) if self.mlp == "swiglu" else (width,)

    def num_params(self, non_embedding=True):
        """Parameters of the whole model (unsharded, counted on a model without storage);
        non_embedding leaves out the lookups that are no matmul (learned positions, an untied token
        embedding)."""
        with torch.device("meta"):
            model = GPT(self, seed=None)
        n = sum(p.numel() for p in model.parameters())
        if non_embedding:
            n -= model.wpe.weight.numel() if model.wpe is not None else 0
            n -= 0 if self.tie_embeddings else model.wte.weight.numel()
        return n


# -----------------------------------------------------------------------------
# tensor-parallel layers


def autocast_input(x):
    """Under autocast, cast before f, so that its backward all-reduce carries bf16 gradients (the
    matmul would cast anyway; a norm's output is fp32 under autocast)."""
    return x.to(torch.get_autocast_dtype(x.device.type)) if torch.is_autocast_enabled(x.device.type) else x


class ColumnParallelLinear(nn.Module):
    """y = f(x) A^T + b with A split by output rows; each rank owns out/tp outputs. No
    communication in forward; f all-reduces the input gradient in backward.

        A = [ A_0 ]   rank 0 computes x A_0^T  (B, T, out/tp)
            [ A_1 ]   rank 1 computes x A_1^T
    `sections` (sizes summing to d_out) splits the output first (QKV: [Q|K|V], SwiGLU: [gate|up])
    and gives each rank its slice of every section, so rank r owns whole heads of Q, K and V. `split`: one
    output tensor per section (SwiGLU: the backward's pointwise pass then writes the gate's and the up's
    gradients apart, reading its inputs once; into one tensor, each half reads them again)."""

    def __init__(self, d_in, d_out, comm, bias=True, sections=None, split=False):
        super().__init__()
        self.comm = comm
        self.sections = tuple(sections or (d_out,))
        self.local = tuple(n // comm.size for n in self.sections)  # this rank's sections
        self.split = split
        self.weight = nn.Parameter(torch.empty(d_out // comm.size, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out // comm.size)) if bias else None
        self.weight.tp_split = True
        if bias:
            self.bias.tp_split = True

    def shard(self, full):  # full: (d_out, ...) -> this rank's rows
        parts = full.split(self.sections, dim=0)
        return torch.cat([s.chunk(self.comm.size, dim=0)[self.comm.rank] for s in parts], dim=0)

    def forward(self, x):  # x: (B, T, in), sequence parallelism: (B, T/tp, in)
        w = recompute.autocast_weight(self.weight)
        sections = self.local if self.split else None
        return parallel.f(autocast_input(x), w, self.bias, self.comm, sections)  # (B, T, out/tp), split: a tuple


class RowParallelLinear(nn.Module):
    """y = g(x A^T) + b with A split by input columns; the input arrives already split (the
    output of a column-parallel layer), each rank computes a partial sum, g all-reduces it.

        A = [ A_0 | A_1 ]   y = x_0 A_0^T + x_1 A_1^T   (the sum is the TP all-reduce)
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
        w = recompute.autocast_weight(self.weight)
        y = parallel.g(F.linear(x, w), self.comm)  # (B, T, out), SP: (B, T/tp, out)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r owns rows [r*V/tp, (r+1)*V/tp) of the (padded) token embedding; tokens outside
    the range look up zeros, and g sums the ranks' partial embeddings (comm: the "embed" site's)."""

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
        return parallel.g(self.lookup(idx, self.weight, self.start), self.comm)  # (B, T, C), SP: (B, T/tp, C)


class LMHead(ColumnParallelLinear):
    """The LM head, a column-parallel linear over the (padded) vocabulary: rank r owns the logits of
    columns [r*V/tp, (r+1)*V/tp). forward gives them (generation); loss fuses them with the
    cross-entropy (training), so that they are never whole."""

    def loss(self, x, targets, n_real, chunk):
        """Mean cross-entropy of x (B, T, C) against targets (B, T) (-1: ignored) over the n_real real
        columns, chunk tokens at a time (0: all at once). Vocab-parallel (Megatron's loss): each rank reduces
        its own columns' logits to a max, a sum of exponentials and the target's logit, per token; two tiny
        exact all-reduces over TP combine them into log-sum-exp, so no rank ever holds all V logits. Fused
        with the head (loss.py, an appendix): chunk by chunk of tokens, the gradients made while each chunk's
        logits exist, so that no (tokens, V/tp) tensor is ever whole either."""
        x = parallel.f(autocast_input(x), None, None, self.comm)  # f alone: its all-reduce of grad_x backward
        return fused_linear_cross_entropy(
            x.flatten(0, -2), self.weight, targets.flatten(), self.comm, n_real, chunk, torch.is_grad_enabled()
        )


# -----------------------------------------------------------------------------
# the parts


class RMSNorm(nn.Module):
    """RMSNorm in Hugging Face's order: normalise in fp32, cast back, then the weight."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def norm(cfg, dim=None):
    """The family's norm over the last dimension (dim: n_embd unless given)."""
    dim = dim or cfg.n_embd
    return RMSNorm(dim, cfg.norm_eps) if cfg.norm == "rmsnorm" else nn.LayerNorm(dim, cfg.norm_eps, bias=cfg.norm_bias)


def rotary(T, cfg, device):
    """cos, sin (T, head_dim) in fp32 of Hugging Face's half-split rotary embedding: dimension i and
    i + head_dim/2 of a head form one pair, rotated by the angle pos * f_i, f_i = theta^(-2i/head_dim).
    llama3 scaling bands the frequencies by wavelength w = 2 pi / f against the original context n:
    w < n / high_freq: kept; w > n / low_freq: divided by factor; between, a blend of the two with the
    weight s = (n / w - low_freq) / (high_freq - low_freq) on the kept one."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim)
    if cfg.rope_scaling == "llama3":
        n, lo, hi = cfg.rope_original_positions, cfg.rope_low_freq, cfg.rope_high_freq
        wavelength = 2 * math.pi / inv_freq
        s = ((n / wavelength - lo) / (hi - lo)).clamp(0.0, 1.0)  # 0 past n / lo, 1 below n / hi
        inv_freq = (1 - s) * inv_freq / cfg.rope_factor + s * inv_freq
    angles = torch.arange(T, device=device).float()[:, None] * torch.cat((-inv_freq, inv_freq))  # (T, head_dim)
    return angles.cos(), angles.sin()  # the first half's angles negated: sin(-a) = -sin(a) is rotate_half's sign


def apply_rotary(x, cos, sin):  # x: (B, T, h, hd), cos, sin: (T, 1, hd), cast to x's dtype (as HF)
    return x * cos.to(x.dtype) + x.roll(x.shape[-1] // 2, dims=-1) * sin.to(x.dtype)  # HF's (-x2, x1): sin signed


class CausalSelfAttention(nn.Module):
    """Attention on this rank's heads: n_head/tp query heads and the n_kv_head/tp key/value heads
    they read (grouped-query when n_kv_head < n_head); q and k optionally RMS-normed per head, then
    rotated (rotary positions)."""

    def __init__(self, cfg, comm):
        super().__init__()
        self.hd = cfg.head_dim
        self.gqa = cfg.n_kv_head != cfg.n_head
        width = sum(cfg.qkv_sections)
        self.qkv = ColumnParallelLinear(cfg.n_embd, width, comm, cfg.qkv_bias, sections=cfg.qkv_sections)
        self.proj = RowParallelLinear(cfg.n_head * cfg.head_dim, cfg.n_embd, comm, cfg.linear_bias)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            # Replicated on every TP rank, but each rank's gradient comes from its own heads only: a
            # partial sum over TP, which parallel.sync_replicated_grads completes.
            self.q_norm, self.k_norm = norm(cfg, cfg.head_dim), norm(cfg, cfg.head_dim)
            self.q_norm.weight.tp_partial_grad = self.k_norm.weight.tp_partial_grad = True
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x, rope=None):  # x: (B, T, C), with sequence parallelism (B, T/tp, C)
        q, k, v = (
            rearrange(t, "b t (h d) -> b t h d", d=self.hd)  # (B, T, h/tp or kv/tp, hd): rotated tokens-major
            for t in self.qkv(x).split(self.qkv.local, dim=-1)  # (B, T, (h + 2kv) hd/tp): this rank's whole heads
        )
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, T, hd) views, as attention reads them
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0, enable_gqa=self.gqa
        )  # (B, h/tp, T, hd)
        return self.resid_drop(self.proj(rearrange(y, "b h t d -> b t (h d)")))  # (B, T, h hd/tp) -> (B, T, C)


class MLP(nn.Module):
    """gelu: proj(GELU(fc(x))); swiglu: proj(silu(gate) * up) with fc = [gate|up]."""

    def __init__(self, cfg, comm):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        sections = cfg.fc_sections
        self.fc = ColumnParallelLinear(cfg.n_embd, sum(sections), comm, cfg.linear_bias, sections, split=self.swiglu)
        self.proj = RowParallelLinear(cfg.intermediate_size, cfg.n_embd, comm, cfg.linear_bias)
        self.drop = nn.Dropout(cfg.dropout)
        self.recompute = cfg.recompute

    def act(self, h):  # h: (B, T, I/tp); SwiGLU: (gate, up), each (B, T, I/tp)
        if self.swiglu:
            gate, up = h
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh")

    def up(self, x):
        return self.act(self.fc(x))

    def forward(self, x):
        h = recompute.mlp_hidden(self, x, self.recompute) if self.recompute and self.training else self.up(x)
        return self.drop(self.proj(h))  # (B, T, I/tp) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg, comm):
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg, comm.at("attn"))
        self.ln_2 = norm(cfg)
        self.mlp = MLP(cfg, comm.at("mlp"))
        self.recompute = cfg.recompute

    def forward(self, x, rope=None):
        x = x + self.attn(self.normed(self.ln_1, x), rope)
        return x + self.mlp(self.normed(self.ln_2, x))

    def normed(self, ln, x):
        """ln(x) as the next matmul reads it (bf16 under autocast); recompute=pointwise: made again in the
        backward from x, which the residual stream keeps anyway, instead of kept beside it."""
        n = lambda t: autocast_input(ln(t))
        return recompute.again(n, x) if self.recompute == "pointwise" and self.training else n(x)


# -----------------------------------------------------------------------------
# the whole model


class GPT(nn.Module):
    """The whole model (stages=1) or one pipeline stage of it: stage s owns blocks [s * per, (s + 1) * per),
    per = n_layer / stages; the first stage also owns the embeddings, the last the final norm and the LM
    head, a column-parallel linear. Tied, its weight IS the token embedding's: with stages > 1 the last stage
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
        self.wpe = None
        if self.first or (self.last and c.tie_embeddings):
            self.wte = VocabParallelEmbedding(c.padded_vocab, c.n_embd, self.comm.at("embed"))
            self.wte.weight.pp_tied_copy = not self.first  # counted once in the gradient norm
        if self.first:
            self.wpe = nn.Embedding(c.block_size, c.n_embd) if c.positions == "learned" else None
            self.drop = nn.Dropout(c.dropout)
        if c.positions == "rotary":  # made once: compiled, each block then reads a table instead of computing cos, sin
            cos, sin = rotary(c.block_size, c, "cpu")
            self.register_buffer("rope_cos", cos, persistent=False)  # not in the state dict: a function of the config
            self.register_buffer("rope_sin", sin, persistent=False)
        self.h = nn.ModuleList([Block(c, self.comm) for _ in self.layers])
        if self.last:
            self.ln_f = norm(c)
            self.lm_head = LMHead(c.n_embd, c.padded_vocab, self.comm, bias=False)
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
        if c.positions == "learned":
            yield self.wpe, "weight", (c.block_size, C), 0.02
        for i in range(c.n_layer):
            b = owned.get(i)
            yield b and b.attn.qkv, "weight", (sum(c.qkv_sections), C), 0.02
            yield b and b.attn.proj, "weight", (C, c.n_head * c.head_dim), proj_std
            yield b and b.mlp.fc, "weight", (sum(c.fc_sections), C), 0.02
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
    def forward(self, idx, targets=None, hidden=None, all_positions=False):
        """idx: (B, T) token ids (first stage), hidden: (B, T, C) from the previous stage (others).
        Returns (logits, loss) on the last stage: with targets the loss alone (None, loss: the head
        fused with it); without, this rank's vocabulary slice of the logits (B, 1, V_padded/tp) of the
        last position (all_positions: of every one). Other stages return (hidden state, None)."""
        c = self.config
        sp = self.comm.size if self.comm.sp else 1  # sequence parallelism: each rank holds T / sp positions
        if self.first:
            B, T = idx.shape
            assert T <= c.block_size, f"sequence length {T} > block_size {c.block_size}"
            assert T % sp == 0, f"sequence parallelism needs T ({T}) divisible by tp"
            x = self.wte(idx)  # (B, T, C), SP: (B, T/tp, C)
            if self.wpe is not None:
                pos = torch.arange(T, device=idx.device).chunk(sp)[self.comm.rank if sp > 1 else 0]  # SP: its slice
                x = x + self.wpe(pos)
            x = self.drop(x)
        else:
            x = hidden
        T = x.shape[1] * sp
        rope = (self.rope_cos[:T, None], self.rope_sin[:T, None]) if c.positions == "rotary" else None
        for block in self.h:  # recompute=block: only x is kept; the backward runs the block's forward again
            x = recompute.again(block, x, rope) if c.recompute == "block" and self.training else block(x, rope)
        if not self.last:
            return x, None
        if targets is not None:
            return None, self.lm_head.loss(self.ln_f(x), targets, c.vocab_size, c.loss_chunk)
        assert not self.comm.sp, "logits without a loss: not with sequence parallelism"
        return self.lm_head(self.ln_f(x if all_positions else x[:, -1:, :])), None  # (B, T or 1, V/tp)
