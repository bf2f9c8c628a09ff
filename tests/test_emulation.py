"""lab/emulate.py: one process reproduces a real TP=t run's compressed all-reduces."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import config
import lab.emulate
import parallel
import taco
import taco_ext
from lab.emulate import SITES, emulate_tp, emulated_all_reduce, parse_sites, site_of
from launcher import run_ranks
from model import GPT, GPTConfig
from test_parallel import CFG, QWEN, _train_steps


def _real_tp_all_reduces(rank, world, codec, cfg=CFG):
    """One training step on `world` gloo ranks; every TP all-reduce's codec, input and output."""
    log = []
    orig = taco.all_reduce

    def recording(x, *args, async_op=False, **kw):  # the async one run blocking: same bits
        before = x.clone()
        orig(x, *args, **kw)
        log.append((kw["codec"], before, x.clone()))
        return taco_ext.Pending(None) if async_op else x

    taco.all_reduce = recording
    comm = parallel.TPComm(group=dist.group.WORLD, size=world, rank=rank, fwd_codec=codec, bwd_codec=codec)
    _train_steps(GPT(cfg, comm, seed=3), steps=1)
    return log


def _emulated_all_reduces(t, codec, monkeypatch, cfg=CFG):
    log = []

    def recording(partials, **kw):
        out = emulated_all_reduce(partials, **kw)
        log.append((kw["codec"], list(partials), out))
        return out

    monkeypatch.setattr(lab.emulate, "emulated_all_reduce", recording)
    comm = parallel.TPComm(fwd_codec=codec, bwd_codec=codec)
    _train_steps(emulate_tp(GPT(cfg, comm, seed=3), t, comm), steps=1)
    return log


def sq(a, b):
    return sum((a[n].double() - b[n].double()).pow(2).sum().item() for n in a)


@pytest.mark.parametrize("t, cfg", [(2, CFG), (4, CFG), (4, QWEN)], ids=["gpt2-2", "gpt2-4", "qwen2-4"])
def test_emulation_makes_the_real_runs_all_reduces(t, cfg, monkeypatch):
    """One training step with every TP all-reduce compressed by `hint8`, on t gloo ranks and
    emulated in one process. Exact by construction: the emulation makes the same all-reduces in the
    same order (codec, shapes), the forward ones from the same inputs bit for bit, and
    emulated_all_reduce of the t real ranks' inputs is every rank's real output bit for bit.
    The backward inputs agree to rounding, not bits: the real run's vocab-parallel softmax sums are
    reduced in another order, so the first backward input is an ulp or so apart (relative 1e-6), and
    an ulp can make a code round the other way. Such a code moves its value by one step, the
    block's absmax / 127, at most 1/127 of the tensor's norm, and the layers below carry it: so the
    later backward inputs are held to 1e-2 (a mis-sliced emulation is off by O(1)). Qwen2: the fused
    QKV's unequal sections (grouped-query attention) and SwiGLU's [gate|up] sliced as on t ranks;
    silu over one rank's slice and over the whole may round an ulp apart, so from the first MLP on the
    bounds are those of the backward (1e-6, then 1e-2 once a code may have rounded the other way)."""
    real = run_ranks(_real_tp_all_reduces, t, "hint8", cfg)
    emu = _emulated_all_reduces(t, "hint8", monkeypatch, cfg)
    n_fwd = 1 + 2 * cfg.n_layer  # the embedding, attention and MLP outputs
    assert len(emu) == len(real[0]) == 2 * n_fwd
    for i, (codec, partials, out) in enumerate(emu):
        assert [r[i][0] for r in real] == [codec] * t == ["hint8"] * t, i
        inputs = [r[i][1] for r in real]
        assert [p.shape for p in partials] == [x.shape for x in inputs], i
        bound = 0 if i < n_fwd else 1e-6 if i == n_fwd else 1e-2
        if cfg.family == "qwen2" and i >= 2:  # from the first SwiGLU on: silu of a (B, T, I/t) slice and of the
            bound = max(bound, 1e-6 if i == 2 else 1e-2)  # whole (B, T, I) may round an ulp apart (vector body vs tail)
        for p, x in zip(partials, inputs):
            assert (p - x).norm() <= bound * x.norm(), (i, ((p - x).norm() / x.norm()).item())
        reduced = emulated_all_reduce(inputs, codec=codec)
        assert all(torch.equal(reduced, r[i][2]) for r in real), i
        assert not torch.equal(reduced, taco.rank_order_sum(inputs)), i  # the codec did act


def test_uncompressed_emulation_equals_single_rank():
    ref = _train_steps(GPT(CFG, seed=3), steps=4)[0]
    comm = parallel.TPComm()
    emu = _train_steps(emulate_tp(GPT(CFG, comm, seed=3), 4, comm), steps=4)[0]
    assert emu == pytest.approx(ref, rel=1e-5)


def test_sites_narrow_the_compression():
    """--sites: listing every site changes nothing; compressing no site is the uncompressed run; one
    site alone differs from both; the gradient effects of the sites add up roughly to the whole
    (not exactly: the errors interact); `site=codec` is that codec at that site only, as the book's
    TPComm.site_codecs (train.py's tp_codec_attn) makes it."""

    def grads(codec, sites):
        comm = parallel.TPComm(fwd_codec=codec, bwd_codec=codec)
        model = emulate_tp(GPT(CFG, comm, seed=3), 4, comm, None if sites is None else parse_sites(sites))
        return _train_steps(model, steps=1)[1]

    every, plain = grads("hint8", None), grads("none", None)
    assert sq(grads("hint8", "attn,mlp,ends"), every) == 0
    assert sq(grads("hint8", ""), plain) == 0
    effect = {s: sq(grads("hint8", s), plain) for s in SITES}
    assert all(e > 0 for e in effect.values()), effect
    assert 0.5 < sum(effect.values()) / sq(every, plain) < 2, effect
    assert sq(grads("hint8", "attn=hint6,mlp,ends"), grads("hint8", "attn,mlp,ends")) > 0
    assert sq(grads("none", "attn=hint6"), plain) == 0  # off where the run does not compress
    book = parallel.TPComm(fwd_codec="hint8", bwd_codec="hint8", site_codecs={"attn": "hint6"})  # tp_codec_attn
    assert (
        sq(_train_steps(emulate_tp(GPT(CFG, book, seed=3), 4, book), steps=1)[1], grads("hint8", "attn=hint6,mlp,ends"))
        == 0
    )
    with pytest.raises(SystemExit, match="unknown site 'mpl'"):
        parse_sites("mpl")
    assert [site_of(n) for n in ("h.0.attn.qkv", "h.5.mlp.proj", "wte", "lm_head")] == ["attn", "mlp", "ends", "ends"]


def _graph_or_eager_steps(graph, steps=6):
    """Losses, and the first step's gradients, of a small emulated model (bf16 autocast, hint8 on every
    all-reduce, TP=4 emulated, a new batch every step, AdamW and gradient clipping as train.py does)."""
    from lab.emulate import capture

    cfg = GPTConfig(
        block_size=64,
        vocab_size=500,
        n_layer=2,
        n_head=4,
        n_embd=256,
    )
    comm = parallel.TPComm(fwd_codec="hint8", bwd_codec="hint8")
    model = emulate_tp(GPT(cfg, comm, seed=3).cuda(), 4, comm)
    if graph:
        capture(model, config.Settings(batch_size=8, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    gen, losses, first = torch.Generator().manual_seed(7), [], None
    for _ in range(steps):
        x, y = (torch.randint(0, cfg.vocab_size, (8, 64), generator=gen).cuda() for _ in range(2))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        first = first or {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_matches_eager():
    """lab.emulate --graph against eager: the eager emulation is deterministic (two runs, bit for
    bit); the replayed forward is the eager one (the first loss, bit for bit), and so are the
    weight-matrix gradients, while the bias gradients (a sum over rows in bf16) may round
    differently by a bf16 unit in the last place — so graph runs are not bit-identical to eager
    ones, and the study keys them apart; the next losses then drift by rounding only."""
    (eager, eg), (again, ag), (graph, gg) = (_graph_or_eager_steps(g) for g in (False, False, True))
    assert eager == again and all(torch.equal(eg[n], ag[n]) for n in eg)
    assert graph[0] == eager[0]
    for n, g in eg.items():
        if n.endswith("bias"):
            assert (gg[n] - g).abs().max() <= g.abs().max() * 2.0**-7, n
        else:
            assert torch.equal(gg[n], g), n
    assert all(abs(a - b) <= 3e-4 * abs(a) for a, b in zip(eager, graph))


def test_emulation_refuses_key_value_heads_it_cannot_split():
    """Qwen2's grouped-query heads: TP=4 emulated needs n_kv_head divisible by 4, as real TP=4 does."""
    import config

    cfg = config.parse(["configs/study_qwen.py", "--n_kv_head=2", "--n_head=28"])
    with pytest.raises(SystemExit, match="n_kv_head=2 is not divisible by tp=4"):
        lab.emulate.check(cfg, 4)
    lab.emulate.check(dataclasses.replace(cfg, n_kv_head=4), 4)
