"""train.py end to end on the small real-text dataset: compressed TP training tracks the
uncompressed curve, checkpoint/resume is bit-exact, bad configurations are refused clearly."""

import json
import os
import subprocess
import sys

import pytest
import torch

import checkpoint
from launcher import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=32",
    "--batch_size=4",
    "--eval_iters=2",
    "--progress=False",
    "--sample_tokens=0",
    "--log_interval=1",
]


def run(args, nproc=1, check=True, module=None):
    """train.py (or `python -m module`, e.g. lab.tahquant) on nproc ranks of the test's rank pool."""
    p = launch(module or "train.py", args, nproc)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def losses(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["loss"] for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


@pytest.mark.slow  # three 40-step runs at 2 ranks; the layouts' compressed runs are tested fast (test_pipeline.py)
def test_compressed_tp2_tracks_uncompressed(tmp_path):
    """40 steps of TP=2 on Shakespeare: the loss falls by > 2 nats either way; with taco (E4M3) or
    hint8 on every TP all-reduce the curve stays within 0.05 nats (about 0.5-1%) of the uncompressed one."""
    curves = {}
    for codec in ("none", "taco", "hint8"):
        out = str(tmp_path / codec)
        run(
            TINY
            + [
                "--tp=2",
                f"--tp_codec={codec}",
                "--max_iters=40",
                "--eval_interval=40",
                "--taco_min_bytes=0",
                f"--out_dir={out}",
            ],
            nproc=2,
        )
        curves[codec] = losses(out)[0]
        with open(os.path.join(out, "log.jsonl")) as f:
            ratio = next(r for r in map(json.loads, f) if "tp_ratio" in r)["tp_ratio"]
        assert ratio > 3.5 if codec != "none" else ratio == 1.0  # fp32 on CPU: 4 bytes -> ~1.02
    base = curves["none"]
    assert len(base) == 40 and base[-1] < base[0] - 2.0
    for codec in ("taco", "hint8"):
        dev = max(abs(a - b) for a, b in zip(curves[codec], base))
        assert dev < 0.05, (codec, dev)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipped, and a norm under the limit
def test_clipping_folded_into_a_fused_adamw_step_is_clipping(max_norm):
    """A fused AdamW takes the clip as its grad_scale (the gradients divided as it reads them):
    the same update as scaling the gradients first, to fp32 rounding."""
    import optim
    import train

    grid = train.parallel.Grid(tp=1, pp=1, dp=1)
    torch.manual_seed(0)
    ps = [torch.randn(64, 32, requires_grad=True), torch.randn(32, requires_grad=True)]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    before = [p.detach().clone() for p in ps]
    for p, q in zip(ps, qs):
        p.grad = torch.randn_like(p) * 3
        q.grad = p.grad.clone()
    # eps=1: the update depends on the gradients' scale (Adam's first step with a small eps barely does)
    plain, fused = optim.AdamW(ps, lr=1e-2, eps=1.0), optim.AdamW(qs, lr=1e-2, eps=1.0, fused=True)
    n1, c1 = train.clip_grad_norm(ps, max_norm, grid)
    n2, c2 = train.clip_grad_norm(qs, max_norm, grid)
    assert n1 == n2 and torch.equal(c1, c2)
    plain.step(c1)
    fused.step(c2)
    assert hasattr(fused, "grad_scale") and not hasattr(plain, "grad_scale")
    assert (fused.grad_scale > 1) == (max_norm < n1)
    for p, q, b in zip(ps, qs, before):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        assert (p - b).abs().max() > 1e-5  # the step moved them


@pytest.mark.parametrize("max_norm", [0.5, 0.0])  # clipped, and clipping off (coef 1)
def test_clip_adamw_is_torch_adamw_after_clipping(max_norm):
    """ClipAdamW's compiled step with the clip's coefficient (clip_grad_norm hands it over): torch.optim.AdamW's
    steps on gradients clipped first, to fp32 rounding, both parameter groups (weight decay on one), the state
    where torch keeps it."""
    import optim
    import train

    grid = train.parallel.Grid(tp=1, pp=1, dp=1)
    torch.manual_seed(0)
    ps = [torch.randn(64, 32, requires_grad=True), torch.randn(32, requires_grad=True)]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    before = [p.detach().clone() for p in ps]
    groups = lambda w: [{"params": w[:1], "weight_decay": 0.1}, {"params": w[1:], "weight_decay": 0.0}]
    # eps=1e-3: the update depends on the gradients' scale (Adam's first step with a small eps barely does)
    theirs = torch.optim.AdamW(groups(ps), lr=1e-2, betas=(0.9, 0.95), eps=1e-3)
    ours = optim.ClipAdamW(groups(qs), lr=1e-2, betas=(0.9, 0.95), eps=1e-3)
    for step in range(3):
        for p, q in zip(ps, qs):
            p.grad = torch.randn_like(p) * 3
            q.grad = p.grad.clone()
        grads = [q.grad.clone() for q in qs]
        n1, c1 = train.clip_grad_norm(ps, max_norm, grid)
        n2, coef = train.clip_grad_norm(qs, max_norm, grid)
        if c1 is not None:  # torch's AdamW: the gradients clipped first, as torch.nn.utils.clip_grad_norm_ does
            torch._foreach_mul_([p.grad for p in ps], c1)
        assert n1 == n2 and all(torch.equal(q.grad, g) for q, g in zip(qs, grads))  # ours reads them unscaled
        assert (coef is not None and coef < 1) == (max_norm > 0)
        theirs.step()
        ours.step(coef)
        assert all(torch.equal(q.grad, g) for q, g in zip(qs, grads))  # and its step leaves them unscaled
        for p, q, b in zip(ps, qs, before):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
            assert (q - b).abs().max() > 1e-5  # the step moved them
    for p, q in zip(ps, qs):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(ours.state[q][k], theirs.state[p][k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("zero", [False, True, pytest.param("qwen2", marks=pytest.mark.slow)])
def test_resume_is_bit_exact(tmp_path, zero):
    """6 steps in one go == 3 steps, stop, resume, 3 more; also with ZeRO-1 over dp=2 (each DP rank
    saves and reloads its own optimizer shard), and a Qwen2 model at TP=2 x PP=2 (untied head)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    extra, nproc = {
        False: ([], 1),
        True: (["--zero1=True", "--dp_codec=hint8", "--zero_codec=hint4"], 2),
        "qwen2": (["--family=qwen2", "--tokenizer=gpt2", "--n_kv_head=1", "--tie_embeddings=False", "--pp=2"], 2),
    }[zero]
    common = TINY + extra + ["--max_iters=6", "--eval_interval=0", "--warmup_iters=2", "--lr_decay_iters=6"]
    run(common + [f"--out_dir={a}"], nproc=nproc)
    run(
        common[:-3]
        + ["--max_iters=3", "--eval_interval=0", "--warmup_iters=2", "--lr_decay_iters=6", f"--out_dir={b}"],
        nproc=nproc,
    )
    run(common + [f"--out_dir={b}", "--resume"], nproc=nproc)
    name = {False: "tp0_pp0.pt", True: "tp0_pp0_dp1.pt", "qwen2": "tp0_pp1.pt"}[zero]
    ca = torch.load(os.path.join(checkpoint.sets(a)[-1], name), weights_only=False)
    cb = torch.load(os.path.join(checkpoint.sets(b)[-1], name), weights_only=False)
    assert ca["iter"] == cb["iter"] == 6
    for k, v in ca["model"].items():
        assert torch.equal(v, cb["model"][k]), k
    assert losses(a)[0][3:] == losses(b)[0][3:]
    if zero is True:
        assert torch.equal(ca["optimizer"]["m"], cb["optimizer"]["m"]) and ca["optimizer"]["dp"] == [2, 1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp=2"], "the world size 1 is not tp*pp*dp"),
        (["--no_such_key=1"], "unknown setting 'no_such_key'"),
        (["--max_iters=ten"], "--max_iters=ten: expected int"),
        (["--tp_codec=fp4"], "tp_codec='fp4' is not a codec"),
        (["--dataset=nowhere"], "python data/prepare.py nowhere"),
        (["configs/missing.py"], "config file configs/missing.py not found"),
        (["configs"], "configs is a directory, not a config file"),
        (["--out_dir=README.md"], "out_dir='README.md' is a file, not a folder"),
        (["--zero1=True"], "but dp=1: launch 2 processes (dp=2) or set zero1=False"),
        (["--zero_codec=hint4"], "set zero1=True too"),
        (["--pp_codec=zstd"], "pp_codec='zstd' is not a codec"),
        (["--tp_codec_embed=auto"], "tp_codec_embed='auto' is not a codec"),
        (["--tp_codec_mlp=auto"], "tp_codec_mlp='auto' is not a codec"),
        (["--tp_transport=nvlink"], "tp_transport='nvlink': choose one of auto, dist, symm"),
        (["--tp_transport=symm", "--device=cpu"], "tp_transport='symm' needs GPUs"),
        (["--pp=2", "--schedule=zigzag"], "schedule='zigzag': choose one of 1f1b, gpipe"),
        # every value outside its range
        (["--dtype=float16"], "dtype='float16': choose one of auto, float32, bfloat16"),
        (["--device=gpu"], "device='gpu': choose one of auto, cpu, cuda"),
        (["--block_size=0"], "block_size=0 must be >= 1"),
        (["--max_iters=-5"], "max_iters=-5 must be >= 1"),
        (["--batch_size=-4"], "batch_size=-4 must be >= 1"),
        (["--gradient_accumulation_steps=0"], "gradient_accumulation_steps=0 must be >= 1"),
        (["--log_interval=0"], "log_interval=0 must be >= 1"),
        (["--n_layer=0"], "n_layer=0 must be >= 1"),
        (["--taco_chunks=0"], "taco_chunks=0 must be >= 1"),
        (["--eval_iters=0"], "eval_iters=0 with eval_interval > 0"),
        (["--codec_block=100"], "codec_block=100 must be a power of two"),
        (["--tp_codec="], "tp_codec='' is not a codec"),
        (["--dropout=1.5"], "dropout=1.5 must be in [0, 1)"),
        (["--dropout=1.0"], "dropout=1.0 must be in [0, 1)"),
        (["--beta1=1.0"], "beta1=1.0 must be in [0, 1)"),
        (["--beta2=1.0"], "beta2=1.0 must be in [0, 1)"),
        (["--timeout=0"], "timeout=0 must be >= 1"),
        (["--loss_chunk=-1"], "loss_chunk=-1 must be >= 0"),  # negative: every step's loss was 0.0000
        (["--recompute=all"], "recompute='all': choose one of '', pointwise, mlp, block"),  # else nothing recomputed
        (["--learning_rate=nan"], "--learning_rate=nan: a finite number is needed"),
        (
            ["--family=llama"],
            "python data/prepare.py small_llama3 --corpus=small --tokenizer=llama3, and train with "
            "--dataset=small_llama3",
        ),  # a name of its own: never data/small, which the CPU demo reads
        # the Qwen2 family's heads: whole key/value heads per TP rank, whole query groups per key/value head
        (["--family=gemma"], "family='gemma': choose one of gpt2, qwen2, llama, qwen3, mistral"),
        (["--arch=qwen2"], "unknown setting 'arch'; it is now family"),
        (["--family=qwen2", "--n_head=4", "--n_kv_head=3"], "n_head=4 is not a multiple of n_kv_head=3"),
        (["--family=qwen2", "--tp=2", "--n_head=4", "--n_kv_head=1"], "n_kv_head=1 is not divisible by tp=2"),
        (
            ["--family=qwen2", "--tp=4", "--n_head=6", "--n_kv_head=2", "--n_embd=96"],
            "n_head=6 is not divisible by tp=4",
        ),
        (["--family=qwen2", "--n_head=8", "--n_embd=120"], "the head size n_embd/n_head = 15 must be even"),
        (["--family=qwen2", "--tp=2", "--intermediate_size=47"], "intermediate_size=47 is not divisible by tp=2"),
        (["--tp=2", "--pp=2", "--intermediate_size=47"], "intermediate_size=47 is not divisible by tp=2"),
        (["--rope_theta=0"], "rope_theta=0.0 must be > 0"),
        (
            ["--n_layer=96", "--n_embd=12288", "--n_head=96", "--block_size=8192"],  # GPT-3 175B's shape
            "each rank needs at least 3180.5 GiB (weights and gradients 1301.5, AdamW's moments 1301.5, "
            "the residual stream 576.0, a loss chunk 1.5)",
        ),
        (["--resume_from=out/x/ckpt/iter_00000004"], "needs --resume and a complete checkpoint set"),
        (
            ["--init_from=tests/fixtures/hf_qwen2_untied", "--n_layer=3", "--family=qwen2"],
            "holds a qwen2 model that these settings contradict: n_layer=3 (the folder's: 2)",
        ),
        (["--init_from=tests/fixtures/hf_qwen2_untied"], "outside the model's vocabulary of 300"),
        (["--init_from=tests"], "--init_from=tests: tests has no config.json"),
    ],
)
def test_bad_config_is_refused_before_launch(args, message):
    """train.py's own checks, in this process (what train.main runs before anything starts)."""
    import config

    world = (
        4
        if "--tp=4" in args or {"--tp=2", "--pp=2"} <= set(args)
        else 2
        if "--pp=2" in args or {"--tp=2", "--family=qwen2"} <= set(args)
        else 1
    )
    with pytest.raises(config.ConfigError) as e:
        config.check(config.parse(args), world)
    assert message in str(e.value)


def test_a_refused_config_ends_the_process_with_its_message():
    p = run(["--tp=2"], check=False)
    assert p.returncode != 0 and "config error: the world size 1 is not tp*pp*dp" in p.stderr + p.stdout


@pytest.mark.parametrize(
    "args, said",
    [
        (["--tp=3"], "config error: the world size 2"),  # an impossible layout
        pytest.param(  # a typo
            ["--max_iter=5"],
            "config error: --max_iter: unknown setting 'max_iter'; did you mean max_iters?",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["configs/no_such_config.py"],
            "config error: config file configs/no_such_config.py not found",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_under_torchrun_a_refusal_is_said_once_and_is_torchruns_root_cause(tmp_path, args, said):
    """Two ranks refuse alike: rank 0 says why, once, with no traceback of ours, first, and then says that
    torchrun's report follows (a refusal, not a crash); its message is the root cause in torchrun's summary;
    the other rank ends quietly."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "train.py",
            *args,
            f"--out_dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = p.stderr.splitlines()
    first = next((i for i, ln in enumerate(lines) if ln.startswith("config error")), None)
    assert p.returncode != 0 and first is not None and lines[first].startswith(said), p.stderr
    banner = ("", "*****", "Setting OMP_NUM_THREADS", "W1", "I1")  # torchrun's own lines before any rank's
    assert all(ln.startswith(banner) for ln in lines[:first]), lines[:first]  # ours is the first word of a rank
    assert lines[first + 1].startswith("(the line above is the whole story: nothing started. torchrun's report")
    assert [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith(said)] == [lines[first]]
    assert "rank      : 0 (local_rank: 0)\n  exitcode  : 1" in p.stderr.split("Root Cause")[1]
    assert f"traceback : {said}" in p.stderr and 'train.py", line' not in p.stderr


def test_nan_loss_stops_the_run(tmp_path):
    p = run(
        TINY
        + ["--max_iters=5", "--learning_rate=1e30", "--warmup_iters=0", "--grad_clip=0.0", f"--out_dir={tmp_path}"],
        check=False,
    )
    assert p.returncode != 0 and "loss is nan" in (p.stderr + p.stdout).lower()


@pytest.mark.slow
def test_torch_compile_with_compressed_tp_matches_eager(tmp_path):
    """--compile=True with TP=2 and hint8 on every TP all-reduce (the autograd Functions that
    communicate run between compiled regions), the loss in three chunks (48 + 48 + 32 tokens: its
    nested compile regions with the all-reduces between them): the same losses as eager, to float
    tolerance; also recomputing, and with sequence parallelism (Qwen2: SwiGLU's two outputs)."""
    args = TINY + [
        "--loss_chunk=48",
        "--tp=2",
        "--tp_codec=hint8",
        "--taco_min_bytes=0",
        "--max_iters=2",
        "--eval_interval=0",
        "--n_layer=1",
    ]
    run(args + [f"--out_dir={tmp_path}/eager"], nproc=2)
    run(args + ["--compile=True", f"--out_dir={tmp_path}/compiled"], nproc=2)
    assert losses(str(tmp_path / "compiled"))[0] == pytest.approx(losses(str(tmp_path / "eager"))[0], rel=1e-5)
    for r in ("mlp", "pointwise"):
        run(args + ["--compile=True", f"--recompute={r}", f"--out_dir={tmp_path}/{r}"], nproc=2)
        assert losses(str(tmp_path / r))[0] == pytest.approx(losses(str(tmp_path / "eager"))[0], rel=1e-5), r
    sp = args + ["--sequence_parallel=True", "--family=qwen2", "--tokenizer=gpt2"]  # f's Function all-gathers
    run(sp + [f"--out_dir={tmp_path}/sp_eager"], nproc=2)
    run(sp + ["--compile=True", f"--out_dir={tmp_path}/sp"], nproc=2)
    assert losses(str(tmp_path / "sp"))[0] == pytest.approx(losses(str(tmp_path / "sp_eager"))[0], rel=1e-5)


def test_recompute_through_train_py_changes_no_loss(tmp_path):
    """train.py with recompute=block at TP=2 x PP=2 (hint8 all-reduces run again in the backward, the
    stages' blocks recomputed): the losses of the run that keeps every activation, bit for bit."""
    args = TINY + "--tp=2 --pp=2 --max_iters=3 --eval_interval=0 --family=qwen2 --tokenizer=gpt2 --dropout=0.1".split()
    run(args + [f"--out_dir={tmp_path}/kept"], nproc=4)
    run(args + ["--recompute=block", f"--out_dir={tmp_path}/recomputed"], nproc=4)
    assert losses(str(tmp_path / "recomputed"))[0] == losses(str(tmp_path / "kept"))[0]


@pytest.mark.parametrize(
    "world, layout",
    [(8, ["--tp=8"]), (4, ["--tp=4"]), (8, ["--tp=4", "--pp=2", "--gradient_accumulation_steps=4", "--batch_size=2"])],
)
def test_gpt7b_layouts_for_4_and_8_gpus_pass_the_launch_checks(world, layout, monkeypatch):
    """The TP=4/8 layouts of configs/gpt7b.py (for 4- and 8-GPU machines) are accepted before launch
    (here on CPU, the small dataset standing in for the large one, the memory an 80 GiB GPU's); on one
    such GPU the model is refused by the memory bound, naming its parts."""
    import config

    monkeypatch.setattr(config, "memory_here", lambda cfg, ranks: (80 * 2**30, "an H100's memory"))
    g = config.parse(["configs/gpt7b.py", *layout, "--device=cpu", "--dataset=small"])
    assert (g.n_layer, g.n_embd, g.n_head) == (32, 4096, 32)
    config.check(g, world)  # raises ConfigError naming the fix if not
    one = config.parse(["configs/gpt7b.py", "--tp=1", "--device=cpu", "--dataset=small"])
    with pytest.raises(
        config.ConfigError,
        match=r"at least 108\.7 GiB \(weights and gradients 49\.6, AdamW's moments 49\.6, .* an H100's",
    ):
        config.check(one, 1)
