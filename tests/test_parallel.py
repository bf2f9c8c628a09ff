"""Tensor-parallel operators, layers and the whole model against their single-rank equivalents (gloo)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import config
import data_parallel
import model
import parallel
import taco
from launcher import run_ranks
from loss import fused_linear_cross_entropy
from model import GPT, ColumnParallelLinear, GPTConfig, RowParallelLinear


def comm_for(rank, world, **kw):
    return parallel.TPComm(group=dist.group.WORLD, size=world, rank=rank, **kw)


# --- f and g: exact integer checks ---------------------------------------------------------------


def _ops(rank, world):
    comm = comm_for(rank, world)
    x = (torch.ones(3, 5) * (rank + 1)).requires_grad_()
    y = parallel.f(x, torch.eye(5), None, comm)  # f, then a matmul by the identity: exact
    y.backward(torch.ones(3, 5) * (rank + 1))  # f backward: all-reduce of the gradient
    fx, fgrad = y.detach().clone(), x.grad.clone()
    x2 = (torch.ones(3, 5) * (rank + 1)).requires_grad_()
    z = parallel.g(x2, comm)  # g forward: all-reduce
    z.backward(torch.ones(3, 5) * (rank + 1))  # g backward: identity
    return fx, fgrad, z.detach().clone(), x2.grad.clone()


def _tp_suite(rank, world):
    """Every TP check of this file on one launch of `world` ranks (a launch costs seconds)."""
    return {
        "ops": _ops(rank, world),
        "linears": _linears(rank, world),
        "fused": _fused(rank, world),
        "model": _model_tp_vs_single(rank, world),
        "qwen2": _model_tp_vs_single(rank, world, QWEN),
        "qwen2 sp": _model_tp_vs_single(rank, world, QWEN, sp=True),
        "qwen3": _model_tp_vs_single(rank, world, QWEN3),
        "qwen3 sp": _model_tp_vs_single(rank, world, QWEN3, sp=True),
        "llama3": _model_tp_vs_single(rank, world, LLAMA3),
    }


@pytest.fixture(scope="module", params=[2, 4])
def tp(request):
    """(world, [what rank r's _tp_suite returned for r in ranks])."""
    return request.param, run_ranks(_tp_suite, request.param)


def test_f_and_g_are_exact(tp):
    world, results = tp
    total = world * (world + 1) // 2
    for rank, (fx, fgrad, gz, ggrad) in enumerate(r["ops"] for r in results):
        assert torch.equal(fx, torch.ones(3, 5) * (rank + 1))
        assert torch.equal(fgrad, torch.ones(3, 5) * total)
        assert torch.equal(gz, torch.ones(3, 5) * total)
        assert torch.equal(ggrad, torch.ones(3, 5) * (rank + 1))


def test_group_of_one_skips_communication():
    comm = parallel.TPComm()  # no process group at all: any collective would fail
    x, w, b = torch.randn(2, 4), torch.randn(3, 4), torch.randn(3)
    assert parallel.g(x, comm) is x
    assert torch.equal(parallel.f(x, w, b, comm), F.linear(x, w, b))


# --- column / row parallel linear vs nn.Linear ---------------------------------------------------


def _linears(rank, world):
    torch.manual_seed(0)
    comm = comm_for(rank, world)
    ref1, ref2 = nn.Linear(8, 12), nn.Linear(12, 6)
    x = torch.randn(2, 3, 8, requires_grad=True)
    col, row = ColumnParallelLinear(8, 12, comm), RowParallelLinear(12, 6, comm)
    with torch.no_grad():
        col.weight.copy_(col.shard(ref1.weight))
        col.bias.copy_(col.shard(ref1.bias))
        row.weight.copy_(row.shard(ref2.weight))
        row.bias.copy_(ref2.bias)
    xp = x.detach().clone().requires_grad_()
    y = row(F.gelu(col(xp)))
    y_ref = ref2(F.gelu(ref1(x)))
    g = torch.randn_like(y_ref)
    y.backward(g)
    y_ref.backward(g)
    return dict(
        y=(y, y_ref),
        dx=(xp.grad, x.grad),
        w1=(col.weight.grad, col.shard(ref1.weight.grad)),
        b1=(col.bias.grad, col.shard(ref1.bias.grad)),
        w2=(row.weight.grad, row.shard(ref2.weight.grad)),
        b2=(row.bias.grad, ref2.bias.grad),
    )


def test_column_row_parallel_match_nn_linear(tp):
    # fp32; the TP partial sums are added in a different order than one matmul: rounding only
    for res in (r["linears"] for r in tp[1]):
        for name, (ours, ref) in res.items():
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6, msg=name)


# --- the fused, vocab-parallel LM head and cross-entropy vs the logits and F.cross_entropy -----------


def _fused(rank, world):
    """LMHead.loss at TP=world on its slice of a (16 padded, 11 real)-column head (at TP=4 the last
    rank's columns are all padding), in chunks of 3, all at once and more than all: the loss, grad_h
    (complete: f's all-reduce), this rank's grad_A, and the same from the logits whole through
    F.cross_entropy."""
    g = torch.Generator().manual_seed(1)
    h, weight = torch.randn(10, 8, generator=g), torch.randn(16, 8, generator=g)
    targets = torch.randint(0, 11, (10,), generator=g)
    targets[3] = -1  # ignored position
    ref_h, ref_w = h.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy((ref_h @ ref_w.t())[:, :11], targets, ignore_index=-1)  # columns 11 to 15: padding
    ref.backward()
    out = {}
    for chunk in (3, 0, 100):
        head = model.LMHead(8, 16, comm_for(rank, world), bias=False)
        with torch.no_grad():
            head.weight.copy_(head.shard(weight))
        x = h.clone().view(2, 5, 8).requires_grad_()
        loss = head.loss(x, targets.view(2, 5), 11, chunk)
        loss.backward()
        out[chunk] = (
            loss.detach(),
            ref.detach(),
            x.grad.view(10, 8),
            ref_h.grad,
            head.weight.grad,
            head.shard(ref_w.grad),
        )
    return out


def test_fused_head_and_loss_equal_the_logits_and_cross_entropy(tp):
    for per_chunk in (r["fused"] for r in tp[1]):
        for chunk, (loss, ref, gh, ref_gh, gw, ref_gw) in per_chunk.items():
            torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6, msg=f"loss, chunk {chunk}")
            torch.testing.assert_close(gh, ref_gh, rtol=1e-5, atol=1e-7, msg=f"grad_h, chunk {chunk}")
            torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-7, msg=f"grad_A, chunk {chunk}")


@pytest.mark.parametrize("tied", [True, False])
def test_the_models_fused_loss_equals_its_logits_through_cross_entropy(tied):
    """The whole model at TP=1, tied and untied: the fused loss (chunks of 5 tokens of 16) and every
    parameter's gradient equal the logits' (all positions) through F.cross_entropy over the real
    columns; the vocabulary padding (200 real of 256) gets no gradient."""
    cfg = GPTConfig(block_size=8, vocab_size=200, n_layer=1, n_head=2, n_embd=16, tie_embeddings=tied, loss_chunk=5)
    fused, whole = GPT(cfg, seed=0), GPT(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 200, (2, 8), generator=g), torch.randint(0, 200, (2, 8), generator=g)
    targets[0, 3] = -1  # ignored position
    loss = fused(idx, targets)[1]
    logits = whole(idx, all_positions=True)[0]
    ref = F.cross_entropy(logits[..., :200].flatten(0, 1), targets.flatten(), ignore_index=-1)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    loss.backward()
    ref.backward()
    for (n, p), q in zip(fused.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)
    head = fused.lm_head.weight.grad
    assert logits.shape[-1] == 256 and head[200:].abs().max() == 0 and head[:200].abs().max() > 0


@pytest.mark.slow  # compiles a whole model twice over: 30 s and more on 2 cores
@pytest.mark.parametrize("T", [64, 8])
def test_compiled_the_backward_keeps_no_logits_unless_they_are_fewer_bytes_than_the_heads_gradient(T):
    """Compiled under bf16 autocast (width 32, padded vocabulary 256, chunks of T/2 tokens): with 2 x 64
    tokens (at least twice the width) no tensor of the vocabulary's width is kept for the backward but
    the head's own (256, 32); with 2 x 8 tokens the chunks' dz^T (256, 4) are, fewer bytes than the
    head's fp32 gradient (what loss.py's docstring says the partitioner does)."""
    torch._dynamo.reset()
    cfg = GPTConfig(block_size=T, vocab_size=200, n_layer=1, n_head=2, n_embd=32, loss_chunk=T // 2)
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 200, (2, T), generator=g), torch.randint(0, 200, (2, T), generator=g)
    kept = []
    pack = lambda t: kept.append(tuple(t.shape)) or t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.compile(GPT(cfg, seed=0))(idx, targets)[1]
    loss.backward()
    vocab_wide = {s for s in kept if 256 in s}
    assert vocab_wide == ({(256, 32)} if T == 64 else {(256, T // 2)}), sorted(set(kept))


@pytest.mark.parametrize(
    "dtype,N",
    [
        (torch.float32, 64),
        pytest.param(torch.bfloat16, 64, marks=pytest.mark.slow),
        pytest.param(torch.float32, 16, marks=pytest.mark.slow),
    ],
)
def test_compiled_the_fused_loss_and_its_gradients_are_the_eager_ones(dtype, N):
    """torch.compile of the fused loss (4 chunks of N/4 tokens, 200 real columns of 256 at width 32, ignored
    targets) against the same function run eagerly: the loss, grad_h and grad_A equal, fp32 to rounding,
    bf16 within its tolerance, and finite (the padding's -inf logits must never reach a gradient). At 16
    tokens the backward forms grad_A from the chunks' kept dz (the test above)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, 32, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(256, 32, generator=g) * 0.1).requires_grad_()
    t = torch.randint(0, 200, (N,), generator=g)
    t[::5] = -1
    fn = lambda h, w: fused_linear_cross_entropy(h, w, t, parallel.TPComm(), 200, N // 4, True)
    out = {}
    for name, f in (("eager", fn), ("compiled", torch.compile(fn))):
        h.grad = w.grad = None
        loss = f(h, w)
        loss.backward()
        out[name] = (loss.detach(), h.grad.float(), w.grad)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    for what, a, b in zip(("loss", "grad_h", "grad_A"), out["compiled"], out["eager"]):
        assert a.isfinite().all(), what
        torch.testing.assert_close(a, b, **tol, msg=what)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_the_fused_loss_in_bf16_on_a_gpu_is_the_unfused_within_bf16s_tolerance(compiled):
    """On a GPU in bf16 (as under autocast): the fused loss and its gradients, eager and compiled, against
    the whole logits' fp32 cross-entropy: 4,096 tokens in chunks of 1,000, 50,257 real columns of 50,304,
    every 7th target ignored; the padding gets no gradient."""
    dev, N, C, V, real = torch.device("cuda"), 4096, 256, 50304, 50257
    g = torch.Generator(dev).manual_seed(0)
    h = torch.randn(N, C, device=dev, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, C, device=dev, generator=g) * 0.05).requires_grad_()
    t = torch.randint(0, real, (N,), device=dev, generator=g)
    t[::7] = -1
    fn = lambda h, w: fused_linear_cross_entropy(h, w, t, parallel.TPComm(), real, 1000, True)
    loss = (torch.compile(fn) if compiled else fn)(h, w)
    loss.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy((h2 @ w2.bfloat16().t())[:, :real].float(), t, ignore_index=-1)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-3 * ref.item(), (loss.item(), ref.item())
    for name, a, b in (("grad_h", h.grad, h2.grad), ("grad_A", w.grad, w2.grad)):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 1e-2, (name, err)
    assert w.grad[real:].abs().max() == 0


# --- the whole model: TP=N vs TP=1 -----------------------------------------------------------------

CFG = GPTConfig(
    block_size=16,
    vocab_size=500,
    n_layer=2,
    n_head=4,
    n_embd=32,
)
# Qwen2: grouped-query attention (4 query heads reading 2 key/value heads: at TP=4 one of each per
# rank), SwiGLU, RMSNorm, rotary positions, an untied head
QWEN = GPTConfig(
    block_size=16,
    vocab_size=500,
    n_layer=2,
    n_head=8,
    n_kv_head=4,
    n_embd=32,
    intermediate_size=40,
    family="qwen2",
    rope_theta=500.0,
    norm_eps=1e-6,
    tie_embeddings=False,
)


# Qwen3: an explicit head size (8, not 32/8), q/k-norm, grouped-query attention
QWEN3 = GPTConfig(
    block_size=16,
    vocab_size=500,
    n_layer=2,
    n_head=8,
    n_kv_head=4,
    n_embd=32,
    head_dim=8,
    intermediate_size=40,
    family="qwen3",
    rope_theta=500.0,
    norm_eps=1e-6,
    tie_embeddings=False,
)
# Llama 3: rotary positions scaled (an original context of 8, below the 16 positions trained on)
LLAMA3 = GPTConfig(
    block_size=16,
    vocab_size=500,
    n_layer=2,
    n_head=4,
    n_kv_head=4,
    n_embd=32,
    family="llama",
    rope_theta=500.0,
    rope_scaling="llama3",
    rope_factor=4.0,
    rope_original_positions=8,
)


def _train_steps(model, steps=5, sp_grads=None):
    """A few AdamW steps on one fixed random batch; returns the losses and the first step's gradients
    (sequence parallelism: the replicated parameters' gradients summed over TP, as train.py does)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, CFG.vocab_size, (4, 16), generator=gen)
    y = torch.randint(0, CFG.vocab_size, (4, 16), generator=gen)
    losses, grads = [], None
    for _ in range(steps):
        _, loss = model(x, y)
        loss.backward()
        if sp_grads is not None:
            parallel.sync_replicated_grads(list(model.parameters()), sp_grads)
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _shard_like(model_tp, name, full):
    """Slice a TP=1 tensor the way the TP model's parameter `name` is sliced."""
    mod = model_tp.get_submodule(name.rsplit(".", 1)[0])
    p = model_tp.get_parameter(name)
    if not getattr(p, "tp_split", False):
        return full
    return mod.shard(full)


def _model_tp_vs_single(rank, world, cfg=CFG, sp=False):
    ref = GPT(cfg, seed=3)  # TP=1, every rank builds it
    ref_losses, ref_grads = _train_steps(ref)
    tp_model = GPT(cfg, comm_for(rank, world, sp=sp), seed=3)
    init_equal = all(
        torch.equal(p, _shard_like(tp_model, n, q))
        for (n, p), q in zip(tp_model.named_parameters(), GPT(cfg, seed=3).parameters())
    )
    losses, grads = _train_steps(tp_model, sp_grads=tp_model.comm)
    grad_pairs = {n: (g, _shard_like(tp_model, n, ref_grads[n])) for n, g in grads.items()}
    return init_equal, losses, ref_losses, grad_pairs


@pytest.mark.parametrize("family", ["model", "qwen2", "qwen2 sp", "qwen3", "qwen3 sp", "llama3"])
def test_model_tp_matches_single_rank(tp, family):
    # Same initial parameters bit for bit (full init from the seed, then sliced). Losses and
    # gradients differ only by fp32 summation order (partial sums over TP ranks, split softmax):
    # relative 1e-5 on the loss and 1e-4 (rtol) / 1e-6 (atol) on gradients after one step.
    # GPT-2; Qwen2 and Qwen3 (q/k-norm: replicated weights whose gradients are summed over TP)
    # without and with sequence parallelism; Llama 3's scaled rotary positions.
    for init_equal, losses, ref_losses, grads in (r[family] for r in tp[1]):
        assert init_equal
        assert losses[0] == pytest.approx(ref_losses[0], rel=1e-6)
        assert losses == pytest.approx(ref_losses, rel=1e-5)  # the loss curve over 5 AdamW steps
        assert losses[-1] < losses[0] - 0.01  # and it is learning
        for name, (g, ref) in grads.items():
            torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6, msg=name)


def _recomputed(rank, world):
    """Losses and first gradients of a few steps with each `recompute`, at TP=world with hint8 on every
    all-reduce (Qwen2 also with sequence parallelism), and at TP=1 with dropout."""
    import dataclasses

    out = {}
    for name, cfg, kw in (
        ("gpt2", CFG, dict(fwd_codec="hint8", bwd_codec="hint8")),
        ("qwen2 sp", QWEN, dict(fwd_codec="hint8", bwd_codec="hint8", sp=True)),
        ("dropout tp1", dataclasses.replace(CFG, dropout=0.2), None),
    ):
        for r in model.RECOMPUTE:
            comm = comm_for(rank, world, **kw) if kw is not None else None
            torch.manual_seed(5)  # dropout's masks: the recomputation must draw the same
            m = GPT(dataclasses.replace(cfg, recompute=r), comm, seed=3)
            out[name, r] = _train_steps(m, steps=3, sp_grads=m.comm if kw and kw.get("sp") else None)
    return out


def test_recompute_changes_nothing_but_memory():
    """recompute=pointwise | mlp | block: the same losses and gradients bit for bit as keeping every activation,
    through compressed all-reduces run again in the backward and dropout's masks drawn again."""
    for out in run_ranks(_recomputed, 2):
        for name in ("gpt2", "qwen2 sp", "dropout tp1"):
            losses, grads = out[name, ""]
            for r in model.RECOMPUTE[1:]:
                assert out[name, r][0] == losses, (name, r)
                assert all(torch.equal(g, out[name, r][1][n]) for n, g in grads.items()), (name, r)


def _embedding_outputs(rank, world):
    """Rank 0's embedding output (the all-reduced lookup) with hint8 everywhere, with the embedding's
    all-reduce left uncompressed, and with nothing compressed."""
    out = {}
    for name, kw in (
        ("hint8", {}),
        ("embed none", {"embed_codec": "none"}),
        ("none", {"fwd_codec": "none", "bwd_codec": "none"}),
    ):
        comm = comm_for(rank, world, **{"fwd_codec": "hint8", "bwd_codec": "hint8", **kw})
        model = GPT(CFG, comm, seed=3)
        seen = []
        model.wte.register_forward_hook(lambda mod, inp, o: seen.append(o.detach().clone()))
        x = torch.randint(0, CFG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
        loss = model(x, x)[1]
        out[name] = (seen[0], loss.item())
    return out


def test_embedding_codec_applies_to_the_embedding_alone():
    """tp_codec_embed: the embedding's all-reduce takes its own codec ("none": exact, as without
    compression), the other all-reduces keep theirs (the loss still differs from uncompressed)."""
    for out in run_ranks(_embedding_outputs, 2):
        assert torch.equal(out["embed none"][0], out["none"][0])
        assert not torch.equal(out["hint8"][0], out["none"][0])
        assert out["embed none"][1] != out["none"][1]


def _site_losses(rank, world):
    """The loss with hint8 everywhere but the sites (and the embedding) given their own codec, and
    which codec the attention and MLP layers choose."""
    out = {}
    for name, sites in (
        ("hint8", {}),
        ("attn hint6", {"attn": "hint6"}),
        ("attn none", {"attn": "none"}),
        ("exact sites", {"attn": "none", "mlp": "none"}),
    ):
        comm = comm_for(rank, world, fwd_codec="hint8", bwd_codec="hint8", embed_codec="none", site_codecs=sites)
        model = GPT(CFG, comm, seed=3)
        x = torch.randint(0, CFG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
        probe = torch.zeros(1, 1, CFG.n_embd)
        out[name] = (
            model(x, x)[1].item(),
            model.h[0].attn.proj.comm.codec_for(probe, "fwd"),
            model.h[0].mlp.fc.comm.codec_for(probe, "bwd"),
            model.h[0].attn.qkv.comm.stats is comm.stats,
        )
    comm = comm_for(rank, world, fwd_codec="hint8", bwd_codec="none", site_codecs={"attn": "hint6"})
    out["bwd none"] = GPT(CFG, comm, seed=3).h[0].attn.qkv.comm.codec_for(torch.zeros(1), "bwd")
    none = comm_for(rank, world, fwd_codec="none", bwd_codec="none")
    out["none"] = GPT(CFG, none, seed=3)(x, x)[1].item()
    return out


def test_site_codecs_apply_to_their_block_part():
    """tp_codec_attn / tp_codec_mlp: a block part's all-reduces take its codec, in both directions
    (not where a direction is uncompressed), counted in the same stats; with both parts and the
    embedding exact the forward is the uncompressed one bit for bit."""
    for out in run_ranks(_site_losses, 2):
        assert out["hint8"][1:] == ("hint8", "hint8", True) and out["attn hint6"][1:] == ("hint6", "hint8", True)
        assert out["attn none"][1:] == ("none", "hint8", True) and out["bwd none"] == "none"
        assert out["exact sites"][0] == out["none"]
        assert len({out[k][0] for k in ("hint8", "attn hint6", "attn none", "exact sites")}) == 4


# --- configuration checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(tp=2, pp=1, dp=1, world=4), "the world size 4 is not tp\\*pp\\*dp"),
        (dict(tp=2, pp=1, world=3), "launch a multiple of tp\\*pp = 2 processes"),
        (dict(tp=3, pp=1, dp=1, world=3, mc=GPTConfig(n_head=4, n_embd=48)), "n_head=4 is not divisible by tp=3"),
        (dict(tp=1, pp=3, dp=1, world=3, mc=GPTConfig(n_layer=4)), "n_layer=4 is not divisible by pp=3"),
        (dict(tp=0, pp=1, dp=1, world=1), "must be a positive integer"),
        (dict(tp=5, pp=1, dp=1, world=5, mc=GPTConfig(n_head=5, n_embd=80)), "vocabulary"),
        (dict(tp=1, pp=2, world=2, schedule="zigzag"), "schedule='zigzag': choose 1f1b or gpipe"),
    ],
)
def test_bad_layouts_are_refused(kw, message):
    with pytest.raises(config.ConfigError, match=message):
        config.check_layout(**kw)


# --- data parallelism -----------------------------------------------------------------------------


def _dp_grads(rank, world):
    """Two DP ranks, each with half of a batch, average their gradients: the result must be the
    gradient of the whole batch on one rank (equal halves, so the mean of means is the mean)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randint(0, CFG.vocab_size, (4, 16), generator=gen)
    y = torch.randint(0, CFG.vocab_size, (4, 16), generator=gen)
    model = GPT(CFG, seed=3)
    half = slice(2 * rank, 2 * rank + 2)
    model(x[half], y[half])[1].backward()
    sync = data_parallel.DPGradSync(list(model.parameters()), dist.group.WORLD, world, bucket_numel=5000, overlap=False)
    sync.start(1)
    sync.finish()  # every bucket after the backward
    ref = GPT(CFG, seed=3)
    ref(x, y)[1].backward()
    return [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]


def _dp_suite(rank, world):
    return {
        "grads": _dp_grads(rank, world),
        "zero": _zero_vs_adamw(rank, world),
        "overlap": _overlapped_dp(rank, world),
        "async": _async_all_reduce(rank, world),
    }


@pytest.fixture(scope="module")
def dp():
    """What rank r of 2 returned from _dp_suite (the functions below), for r in ranks."""
    return run_ranks(_dp_suite, 2)


def test_dp_gradient_averaging_equals_the_whole_batch(dp):
    for pairs in (r["grads"] for r in dp):
        for g, ref in pairs:  # small buckets: several all-reduces, big params alone
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)


def _zero_vs_adamw(rank, world):
    """The same toy parameters and gradients through ZeroAdamW (dp=world) and torch's AdamW."""
    grid = parallel.Grid(rank=rank, world=world, dp=world, dp_rank=rank, dp_group=dist.group.WORLD)
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (300,), (3, 3, 2)]
    ref = [torch.randn(s, generator=g, requires_grad=True) for s in shapes]
    ours = [p.detach().clone().requires_grad_() for p in ref]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in ref if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ref if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    zero = data_parallel.ZeroAdamW(ours, grid, 1e-2, (0.9, 0.999), 1e-8, 0.1)
    for step in range(3):
        grads = [torch.randn(s, generator=g) for s in shapes]  # the same on every rank
        for p, q, gr in zip(ref, ours, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        zero.reduce_grads()
        zero.step(1e-2)
    return [p.detach() for p in ref], [q.detach() for q in ours], zero.m.numel(), sum(p.numel() for p in ref)


def test_zero_adamw_is_adamw_with_a_sharded_state(dp):
    for ref, ours, state, n in (r["zero"] for r in dp):
        for a, b in zip(ref, ours):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        assert state == 256 and state < n  # 1/dp of the 398 values, padded to a block


def _overlapped_dp(rank, world):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    params = list(net.parameters())
    sync = data_parallel.DPGradSync(params, dist.group.WORLD, world, bucket_numel=200)
    sync.start(2)  # two micro-batches accumulate
    launched_before_finish = []
    for micro in range(2):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * rank + micro))
        net(x).square().sum().backward()
        launched_before_finish.append(len(sync.pending))
    mine = [p.grad.clone() for p in params]
    sync.finish()
    return launched_before_finish, len(sync.buckets), mine, [p.grad for p in params]


def test_overlapped_dp_sync_starts_buckets_during_backward(dp):
    """Buckets start only once the LAST micro-batch has accumulated (none after micro-batch 0, all
    of them by the end of micro-batch 1's backward, before finish()); the result is the average."""
    out = [r["overlap"] for r in dp]
    for launched, nbuckets, _, avg in out:
        assert nbuckets >= 3 and launched == [0, nbuckets]
        for i, g in enumerate(avg):
            torch.testing.assert_close(g, (out[0][2][i] + out[1][2][i]) / 2)


@pytest.mark.parametrize("sections", [None, (2, 4)])
def test_column_parallel_backward_starts_its_all_reduce_before_the_weight_gradient(sections):
    """f fused with the matmul: grad_x's all-reduce is STARTED (async) before grad_W and grad_b are
    computed and waited on before returning; gradients equal nn.functional.linear's autograd, also
    with the output split into one tensor per section (SwiGLU's gate and up)."""
    events = []

    class Handle:
        def wait(self):
            events.append("wait")

    class Comm:
        size, sp = 2, False

        def all_reduce(self, x, direction, async_op=False):
            assert direction == "bwd" and async_op
            events.append("start")
            x.mul_(2)  # a stand-in "sum over 2 identical ranks"
            return Handle()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    w = torch.randn(6, 8, generator=g, requires_grad=True)
    b = torch.randn(6, generator=g, requires_grad=True)
    gy = torch.randn(3, 5, 6, generator=g)
    y = parallel.f(x, w, b, Comm(), sections)
    if sections:
        assert [t.shape for t in y] == [(3, 5, 2), (3, 5, 4)]
        y = torch.cat(y, dim=-1)
    y.backward(gy)
    ours = (x.grad, w.grad, b.grad)
    x.grad = w.grad = b.grad = None
    torch.testing.assert_close(y, F.linear(x, w, b))
    F.linear(x, w, b).backward(gy)
    assert events == ["start", "wait"]
    torch.testing.assert_close(ours[0], 2 * x.grad)
    torch.testing.assert_close(ours[1], w.grad)
    torch.testing.assert_close(ours[2], b.grad)


def _async_all_reduce(rank, world):
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    h = taco.all_reduce(x, codec="hint8", async_op=True)
    h.wait()
    h.wait()  # a second wait is a no-op
    y = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    return x, taco.all_reduce(y, codec="hint8")


def test_async_all_reduce_equals_the_blocking_one(dp):
    for a, b in (r["async"] for r in dp):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_accumulate_mm_adds_the_product_into_the_fp32_accumulator(dtype, compiled):
    """The fused loss's grad_A accumulation: acc += a @ b in place, acc fp32, eager and compiled (where the
    op's mutation must reach the caller's tensor), against the product in fp32 within the inputs' rounding."""
    g = torch.Generator().manual_seed(0)
    acc, a, b = torch.randn(48, 16, generator=g), torch.randn(48, 40, generator=g), torch.randn(40, 16, generator=g)
    want = acc + a.to(dtype).float() @ b.to(dtype).float()

    def add(acc, a, b):
        torch.ops.nanotaco.accumulate_mm(acc, a, b)
        return acc * 1

    out = (torch.compile(add) if compiled else add)(acc, a.to(dtype), b.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(acc, want, rtol=tol, atol=tol * 10)
    torch.testing.assert_close(out, acc)
