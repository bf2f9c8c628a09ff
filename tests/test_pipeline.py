"""Pipeline, data and sequence parallelism through train.py: every layout trains like one rank."""

import json
import os

import pytest

import parallel
import taco
from test_train import ROOT, losses, run

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "golden_losses.json")
TINY = [
    "--n_layer=4",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=32",
    "--batch_size=4",
    "--eval_iters=2",
    "--progress=False",
    "--sample_tokens=0",
    "--log_interval=1",
    "--max_iters=4",
    "--eval_interval=4",
    "--warmup_iters=1",
    "--lr_decay_iters=4",
    "--ckpt_interval=-1",
]


@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("M", [1, 3, 6])
def test_1f1b_schedule(stages, M):
    for s in range(stages):
        acts = parallel.pipeline_schedule("1f1b", M, s, stages)
        assert sorted(acts) == sorted([("fwd", i) for i in range(M)] + [("bwd", i) for i in range(M)])
        assert [i for k, i in acts if k == "bwd"] == list(range(M))  # backwards in order
        in_flight = peak = 0
        for k, i in acts:
            assert k == "fwd" or acts.index(("fwd", i)) < acts.index(("bwd", i))
            in_flight += 1 if k == "fwd" else -1
            peak = max(peak, in_flight)
        assert peak == min(stages - s, M)  # 1F1B's memory bound


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One rank, 4 gradient-accumulation micro-batches per step: what every layout must reproduce."""
    out = str(tmp_path_factory.mktemp("ref"))
    run(TINY + ["--gradient_accumulation_steps=4", f"--out_dir={out}"])
    return losses(out)


def test_reference_matches_golden_file(reference):
    """Regression: the committed curve of this tiny run (CPU, fp32). Tolerance 1e-5 relative: the
    same code gives the same bits; another BLAS may round differently in the last places."""
    with open(FIXTURE) as f:
        golden = json.load(f)
    assert reference[0] == pytest.approx(golden["train"], rel=1e-5)
    assert reference[1][-1]["val_loss"] == pytest.approx(golden["val"], rel=1e-5)


# (tp, pp, dp, schedule): pipeline parallelism does each micro-batch's forward and backward with
# the same arithmetic as one rank, but the clipped gradient norm sums its squares per stage and
# then across stages: another order, so the clip factor (and every later step) may differ in the
# last bits. Exact: the first step's loss (before any update), and every step without clipping
# (test_pipeline_without_clipping_is_bit_exact). Data parallelism sums the micro-batch gradients in
# another order (per rank, then across ranks) and tensor parallelism the partial products:
# tolerance 1e-5 relative on the loss, after 4 AdamW steps.
# DP layouts run with dp_overlap=True (the default: bucket all-reduces started from backward hooks);
# one also without it (all buckets after the backward). The default suite runs one layout of each
# kind (pipeline; data; tensor x pipeline with sequence parallelism), -m slow the rest.
slow = pytest.mark.slow
LAYOUTS = [(1, 2, 1, "1f1b", False), (1, 1, 2, "1f1b", False), (2, 2, 1, "1f1b", True)] + [
    pytest.param(*layout, marks=slow)
    for layout in [
        (1, 2, 1, "gpipe", False),
        (1, 4, 1, "1f1b", False),
        (1, 2, 2, "1f1b", False),
        (2, 2, 1, "1f1b", False),
        (2, 2, 2, "gpipe", False),
        (2, 1, 1, "1f1b", True),
        (1, 1, 2, "no-overlap", False),
    ]
]


@pytest.mark.parametrize("tp, pp, dp, schedule, sp", LAYOUTS)
def test_layout_trains_like_one_rank(tmp_path, reference, tp, pp, dp, schedule, sp):
    out = str(tmp_path)
    extra = ["--dp_overlap=False"] if schedule == "no-overlap" else [f"--schedule={schedule}"]
    run(
        TINY
        + extra
        + [
            f"--tp={tp}",
            f"--pp={pp}",
            f"--gradient_accumulation_steps={4 // dp}",
            f"--sequence_parallel={sp}",
            f"--out_dir={out}",
        ],
        nproc=tp * pp * dp,
    )
    train, evals = losses(out)
    if tp == 1 and dp == 1:
        assert train[0] == reference[0][0]  # no update yet: the same arithmetic
        assert train == pytest.approx(reference[0], rel=1e-6)
    else:
        assert train == pytest.approx(reference[0], rel=1e-5)
    assert evals[-1]["val_loss"] == pytest.approx(reference[1][-1]["val_loss"], rel=1e-5)


# untied: a tied weight's gradient is the first stage's embedding part plus the last stage's head part, summed
# in another order than one rank's autograd sums them (an ulp apart on some CPUs); the grid test above covers tied
NO_CLIP = TINY + ["--grad_clip=0.0", "--gradient_accumulation_steps=4", "--tie_embeddings=False"]


@pytest.fixture(scope="module")
def reference_no_clip(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref_no_clip"))
    run(NO_CLIP + [f"--out_dir={out}"])
    return losses(out)


@pytest.mark.parametrize(
    "pp, schedule", [(2, "1f1b"), pytest.param(2, "gpipe", marks=slow), pytest.param(4, "1f1b", marks=slow)]
)
def test_pipeline_without_clipping_is_bit_exact(tmp_path, reference_no_clip, pp, schedule):
    """Without the clipped norm (whose squares the stages sum in another order) and with untied
    embeddings, a pipeline step is one rank's arithmetic: every loss bit for bit."""
    run(NO_CLIP + [f"--pp={pp}", f"--schedule={schedule}", f"--out_dir={tmp_path}"], nproc=pp)
    pipe = losses(str(tmp_path))
    assert pipe[0] == reference_no_clip[0] and pipe[1][-1]["val_loss"] == reference_no_clip[1][-1]["val_loss"]


def test_verbose_trace_shows_the_schedule(tmp_path):
    p = run(
        TINY
        + [
            "--pp=2",
            "--gradient_accumulation_steps=2",
            "--max_iters=1",
            "--eval_interval=0",
            "--pp_verbose=True",
            f"--out_dir={tmp_path}",
        ],
        nproc=2,
    )
    assert "[rank 1 stage 1] F0: received activation from rank 0" in p.stdout
    assert "[rank 0 stage 0] B1: received gradient from rank 1" in p.stdout


def test_compressed_sequence_parallel_tracks_the_reference(tmp_path, reference):
    """Sequence parallelism with hint8 on every reduce-scatter and all-gather: it really compresses
    (fp32 -> ~1 byte: ratio > 3.5) and stays within 1e-3 nats of the uncompressed curve."""
    run(
        TINY
        + [
            "--tp=2",
            "--sequence_parallel=True",
            "--tp_codec=hint8",
            "--taco_min_bytes=0",
            "--gradient_accumulation_steps=4",
            f"--out_dir={tmp_path}",
        ],
        nproc=2,
    )
    train, _ = losses(str(tmp_path))
    assert max(abs(a - b) for a, b in zip(train, reference[0])) < 1e-3
    with open(os.path.join(tmp_path, "log.jsonl")) as f:
        assert next(r for r in map(json.loads, f) if "tp_ratio" in r)["tp_ratio"] > 3.5


def test_compressed_dp_gradients_track_the_reference(tmp_path, reference):
    """SDP4Bit-style DP: the gradient all-reduce through the two-shot compressed all-reduce with
    hint8 (fp32 -> ~1 byte per value: ratio > 3.5) stays within 0.01 nats of the uncompressed curve
    (the loss itself moves about 0.2 in those steps). Adam divides each
    update by the gradient's running RMS, so gradient noise reaches the weights undamped."""
    run(TINY + ["--dp_codec=hint8", "--gradient_accumulation_steps=2", f"--out_dir={tmp_path}"], nproc=2)
    train, _ = losses(str(tmp_path))
    assert max(abs(a - b) for a, b in zip(train, reference[0])) < 0.01
    with open(os.path.join(tmp_path, "log.jsonl")) as f:
        assert next(r for r in map(json.loads, f) if "dp_ratio" in r)["dp_ratio"] > 3.5


def test_compressed_pipeline_tracks_the_reference(tmp_path, reference):
    """TAH-Quant-style PP: activations between stages in ~3.5-bit tiles (`tahquant`), gradients
    back in hint8, under TP=2 x PP=2 (the two TP ranks of a stage encode the same activation
    identically). The bytes shrink (fp32 -> 4.6 / 8.1 bits: ratio > 4.5) and the loss stays within
    0.02 nats of the uncompressed curve over 4 steps (the loss itself moves ~0.2)."""
    run(
        TINY
        + [
            "--tp=2",
            "--pp=2",
            "--pp_codec=tahquant",
            "--pp_codec_bwd=hint8",
            "--gradient_accumulation_steps=4",
            f"--out_dir={tmp_path}",
        ],
        nproc=4,
        module="lab.tahquant",
    )
    train, _ = losses(str(tmp_path))
    assert max(abs(a - b) for a, b in zip(train, reference[0])) < 0.02
    assert train != reference[0]  # it did compress
    with open(os.path.join(tmp_path, "log.jsonl")) as f:
        assert next(r for r in map(json.loads, f) if "pp_ratio" in r)["pp_ratio"] > 4.5


@pytest.mark.parametrize("tp, pp", [(1, 1), pytest.param(2, 1, marks=slow), pytest.param(1, 2, marks=slow)])
def test_zero1_trains_like_one_rank(tmp_path, reference, tp, pp):
    """ZeRO-1 over dp=2 (optimizer state sharded, gradient reduce-scatter + parameter all-gather)
    with TP or PP: the same losses as one rank (tolerance as for the other DP layouts)."""
    out = str(tmp_path)
    run(
        TINY + [f"--tp={tp}", f"--pp={pp}", "--zero1=True", "--gradient_accumulation_steps=2", f"--out_dir={out}"],
        nproc=tp * pp * 2,
    )
    train, evals = losses(out)
    assert train == pytest.approx(reference[0], rel=1e-5)
    assert evals[-1]["val_loss"] == pytest.approx(reference[1][-1]["val_loss"], rel=1e-5)


def test_zero1_with_sdp4bit_compression_tracks_the_reference(tmp_path, reference):
    """SDP4Bit-style: hint8 gradients (reduce-scatter) and 4-bit weight DIFFERENCES (all-gather):
    within 0.02 nats of the uncompressed curve over 4 steps, and far fewer bytes (fp32 -> 8.1 and
    4.1 bits: a ratio above 4.5 over both collectives)."""
    run(
        TINY
        + [
            "--zero1=True",
            "--dp_codec=hint8",
            "--zero_codec=hint4",
            "--gradient_accumulation_steps=2",
            f"--out_dir={tmp_path}",
        ],
        nproc=2,
    )
    train, _ = losses(str(tmp_path))
    assert max(abs(a - b) for a, b in zip(train, reference[0])) < 0.02
    assert train != reference[0]
    with open(os.path.join(tmp_path, "log.jsonl")) as f:
        assert next(r for r in map(json.loads, f) if "dp_ratio" in r)["dp_ratio"] > 4.5


def test_sampling_through_the_pipeline_matches_one_rank(tmp_path):
    """Generation with pp=2: the context runs through both stages, the last one draws and
    broadcasts each token. Pipeline training is bit-exact, so the sample is the one-rank sample."""
    args = TINY + ["--max_iters=2", "--eval_interval=0", "--sample_tokens=12", "--gradient_accumulation_steps=2"]
    one = run(args + [f"--out_dir={tmp_path}/a"]).stdout
    two = run(args + ["--pp=2", f"--out_dir={tmp_path}/b"], nproc=2).stdout
    sample = lambda out: out[out.index("sample:") : out.index("\ndone: ")]
    assert "sample:" in one and sample(one) == sample(two)


def _pipeline_codecs(rank, world):
    """Two stages (tp = 1), one linear each side: what each stage receives is its neighbour's tensor
    through the codec of its direction."""
    import torch
    import torch.distributed as dist

    grid = parallel.Grid(rank=rank, world=2, pp=2, pp_rank=rank, pp_group=dist.group.WORLD)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, 64, generator=g), torch.randn(64, 64, generator=g) * 0.1
    seen = {}

    def forward(i, h):
        if rank == 0:
            out = (x @ w).requires_grad_()
            seen["sent"] = out.detach().clone()
            out.register_hook(lambda grad: seen.setdefault("grad_in", grad.clone()))
            return out, None
        seen["act_in"] = h.detach().clone()
        h.register_hook(lambda grad: seen.setdefault("grad_sent", grad.clone()))
        return None, (h.pow(3) * 0.01).sum()

    stats = taco.CommStats()
    parallel.run_pipeline(
        parallel.pipeline_schedule("1f1b", 1, rank, 2),
        forward,
        grid,
        (4, 8, 64),
        torch.float32,
        "cpu",
        codec="hint8",
        codec_bwd="hint4",
        stats=stats,
    )
    return seen, stats.ratio


def test_the_pipeline_applies_each_direction_its_own_codec():
    """pp_codec=hint8 forward, pp_codec_bwd=hint4 backward: stage 1 receives hint8's round trip of
    the activation, stage 0 hint4's round trip of the gradient, and the bytes are each codec's."""
    import taco
    from launcher import run_ranks

    (s0, r0), (s1, r1) = run_ranks(_pipeline_codecs, 2)
    hint8, hint4 = taco.get_codec("hint8"), taco.get_codec("hint4")
    assert s1["act_in"].equal(hint8.roundtrip(s0["sent"]))
    assert s0["grad_in"].equal(hint4.roundtrip(s1["grad_sent"]))
    assert 3.8 < r0 < 4.0 and 7.5 < r1 < 7.8  # fp32 -> 8.1 and 4.1 bits per value


# --- the Qwen2 family under the layouts: grouped-query attention, SwiGLU, RMSNorm, rotary, untied head ---
QWEN = TINY + [
    "--family=qwen2",
    "--tokenizer=gpt2",  # the small dataset: GPT-2 ids, on purpose
    "--n_head=4",
    "--n_kv_head=2",
    "--intermediate_size=48",
    "--norm_eps=1e-6",
    "--rope_theta=1000.0",
    "--tie_embeddings=False",
]


@pytest.fixture(scope="module")
def qwen_reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("qwen_ref"))
    run(QWEN + ["--gradient_accumulation_steps=4", f"--out_dir={out}"])
    return losses(out)


# (tp, pp, dp, schedule, sp, extra): the default suite runs TP x PP with sequence parallelism (the
# untied head on the last stage, the key/value heads split over TP); -m slow the rest
QWEN_LAYOUTS = [(2, 2, 1, "1f1b", True, [])] + [
    pytest.param(*layout, marks=slow)
    for layout in [
        (1, 2, 1, "gpipe", False, []),
        (1, 1, 2, "1f1b", False, ["--zero1=True"]),
        (2, 1, 2, "1f1b", False, []),
    ]
]


@pytest.mark.parametrize("tp, pp, dp, schedule, sp, extra", QWEN_LAYOUTS)
def test_qwen2_layout_trains_like_one_rank(tmp_path, qwen_reference, tp, pp, dp, schedule, sp, extra):
    run(
        QWEN
        + extra
        + [
            f"--tp={tp}",
            f"--pp={pp}",
            f"--gradient_accumulation_steps={4 // dp}",
            f"--schedule={schedule}",
            f"--sequence_parallel={sp}",
            f"--out_dir={tmp_path}",
        ],
        nproc=tp * pp * dp,
    )
    train, evals = losses(str(tmp_path))
    assert train == pytest.approx(qwen_reference[0], rel=1e-5)
    assert evals[-1]["val_loss"] == pytest.approx(qwen_reference[1][-1]["val_loss"], rel=1e-5)
    assert qwen_reference[0][-1] < qwen_reference[0][0]


@slow
def test_qwen2_compressed_tp_tracks_the_reference(tmp_path, qwen_reference):
    """hint8 on every TP all-reduce of a Qwen2 model at TP=2: it compresses (ratio > 3.5) and the
    curve stays within 0.01 nats of the uncompressed one."""
    run(
        QWEN
        + [
            "--tp=2",
            "--tp_codec=hint8",
            "--taco_min_bytes=0",
            "--gradient_accumulation_steps=4",
            f"--out_dir={tmp_path}",
        ],
        nproc=2,
    )
    train, _ = losses(str(tmp_path))
    assert max(abs(a - b) for a, b in zip(train, qwen_reference[0])) < 0.01 and train != qwen_reference[0]
    with open(os.path.join(tmp_path, "log.jsonl")) as f:
        assert next(r for r in map(json.loads, f) if "tp_ratio" in r)["tp_ratio"] > 3.5
