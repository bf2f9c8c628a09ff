"""What a user touches: the settings (--help, config files, errors), weights in and out
(init_from, sample.py generate/export, checkpoints merged across layouts), data preparation,
a two-node launch, and the run's files (log.jsonl, out_dir)."""

import ast
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import checkpoint
import config
import hf
from launcher import run_ranks
from model import GPT, GPTConfig
from sample import generate
from test_parallel import comm_for
from test_train import ROOT, TINY, run

MC = dict(n_layer=2, n_head=2, n_embd=32, block_size=32)


# --- settings --------------------------------------------------------------------------------


def test_help_lists_every_setting_with_its_default_and_comment():
    p = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, check=True)
    lines = {ln.split("=")[0].strip(): ln for ln in p.stdout.splitlines() if ln.startswith("  --")}
    defaults = config.Settings().as_dict()
    assert set(lines) == {f"--{k}" for k in defaults}
    for key, line in lines.items():
        default, comment = line[:40].split("=", 1)[1].strip(), line[40:].strip()
        assert comment, f"{key} has no comment"
        assert ast.literal_eval(default) == defaults[key[2:]], line


def test_every_model_field_is_a_setting_and_every_part_value_a_choice():
    """A field added to GPTConfig is a setting of the same name and type (model_config reads them by name), and a
    part's values declared beside Family (model.PART_VALUES) are the choices config.py checks: one place each."""
    import model

    settings = {f.name: f for f in dataclasses.fields(config.Settings)}
    for f in dataclasses.fields(GPTConfig):
        assert f.name in settings, f"GPTConfig.{f.name} has no setting in config.Settings"
        types = {f.type, f.type | None} if isinstance(f.type, type) else {f.type}
        assert settings[f.name].type in types, (f.name, f.type, settings[f.name].type)
    for part, values in model.PART_VALUES.items():
        assert part in model.PARTS and config.CHOICES[part] == values
    for family in model.FAMILIES.values():
        assert all(getattr(family, part) in values for part, values in model.PART_VALUES.items())


def test_config_file_is_checked_like_the_command_line(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("max_iters = 20\nn_layers = 2\n")
    with pytest.raises(config.ConfigError, match=r"c.py:2: unknown setting 'n_layers'; did you mean n_layer\?"):
        config.parse([str(f)])
    f.write_text("# a comment\nmax_iters = '20'\n")
    with pytest.raises(config.ConfigError, match=r"c.py:2: expected int"):
        config.parse([str(f)])
    f.write_text("n_layer = 2\nlearning_rate = 1 / 0\n")
    with pytest.raises(config.ConfigError, match=r"c.py:2: ZeroDivisionError"):
        config.parse([str(f)])
    f.write_text("n_layer = 2\nlearning_rate = 3e-4\nwarmup_iters = 4 * 5\n")
    c = config.parse([str(f), "--max_iters", "7", "--compile", "--resume", "False"])
    assert (c.n_layer, c.learning_rate, c.warmup_iters, c.max_iters) == (2, 3e-4, 20, 7)
    assert c.compile is True and c.resume is False
    with pytest.raises(config.ConfigError, match="did you mean max_iters"):
        config.parse(["--max_iter=5"])
    with pytest.raises(config.ConfigError, match="--max_iters needs a value"):
        config.parse(["--max_iters"])


def test_a_tp_group_must_sit_inside_one_node():
    c = config.parse(["--tp=4"])
    with pytest.raises(config.ConfigError, match="a TP group must sit inside one node"):
        config.check(c, 8, local_world=2)
    assert (
        config.check(
            config.parse(["--tp=2", "--pp=2", "--gradient_accumulation_steps=2", "--eval_iters=2"]),
            8,
            local_world=2,
        )
        == 2
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "holds 0 tokens"),
        (b"\x01\x02\x03", "not a whole number of uint16 tokens"),
        (b"\x01\x00" * 10, "holds 10 tokens"),
        (b"\xff\xff" * 100, "token id 65535, outside the model's vocabulary of 50257"),
        (None, "is not a file of tokens (a folder?)"),
    ],
)
def test_bad_data_files_are_refused_naming_the_file(tmp_path, content, message):
    d = tmp_path / "bad"
    d.mkdir()
    if content is None:
        (d / "train.bin").mkdir()
    else:
        (d / "train.bin").write_bytes(content)
    (d / "val.bin").write_bytes(b"\x01\x00" * 100)
    c = config.parse([f"--data_dir={tmp_path}", "--dataset=bad", "--block_size=16"])
    with pytest.raises(config.ConfigError) as e:
        config.check(c, 1)
    assert message in str(e.value) and str(d / "train.bin") in str(e.value)


# --- weights in and out ------------------------------------------------------------------------


def _hf_weights(seed=0):
    """A random GPT-2-layout state dict (the real vocabulary) with the TINY model's shapes."""
    g = torch.Generator().manual_seed(seed)
    C, L = MC["n_embd"], MC["n_layer"]
    r = lambda *s: torch.randn(*s, generator=g) * 0.1
    sd = {
        "transformer.wte.weight": r(50257, C),
        "transformer.wpe.weight": r(MC["block_size"], C),
        "transformer.ln_f.weight": 1 + r(C),
        "transformer.ln_f.bias": r(C),
    }
    for i in range(L):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            sd[p + ln + ".weight"], sd[p + ln + ".bias"] = 1 + r(C), r(C)
        for name, (i_, o) in {
            "attn.c_attn": (C, 3 * C),
            "attn.c_proj": (C, C),
            "mlp.c_fc": (C, 4 * C),
            "mlp.c_proj": (4 * C, C),
        }.items():
            sd[p + name + ".weight"], sd[p + name + ".bias"] = r(i_, o), r(o)
    return sd


def test_hf_import_then_export_is_bit_exact(tmp_path):
    sd = _hf_weights()
    mc = GPTConfig(**MC)
    save_file(sd, str(tmp_path / "model.safetensors"))
    get = hf.from_hf(hf.Weights(str(tmp_path)), mc)
    back = hf.to_hf({n: get(n) for n in GPT(mc, seed=None).state_dict()}, mc)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.slow
def test_init_from_at_tp2_pp2_and_export_round_trip(tmp_path):
    """train.py --init_from=<HF folder> on TP=2 x PP=2 with a learning rate of 0: the checkpoint set,
    merged and exported, is the imported weights bit for bit (every shard went to the right rank)."""
    sd = _hf_weights(1)
    src, out, exported = tmp_path / "hf", tmp_path / "run", tmp_path / "exported"
    src.mkdir()
    torch.save(sd, src / "pytorch_model.bin")
    json.dump(hf.config_json(GPTConfig(vocab_size=50257, **MC)), open(src / "config.json", "w"))
    run(
        TINY
        + [
            "--tp=2",
            "--pp=2",
            "--gradient_accumulation_steps=2",
            "--max_iters=1",
            "--eval_interval=0",
            "--learning_rate=0",
            "--min_lr=0",
            "--weight_decay=0",
            f"--init_from={src}",
            f"--out_dir={out}",
        ],
        nproc=4,
    )
    subprocess.run(
        [sys.executable, "sample.py", "export", str(out), str(exported)], cwd=ROOT, check=True, capture_output=True
    )
    back = load_file(str(exported / "model.safetensors"))
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    assert json.load(open(exported / "config.json"))["n_layer"] == MC["n_layer"]


def _tiny_vocab_data(folder, vocab, n=4000):
    """train.bin / val.bin of random ids below `vocab` (a fixture model's small vocabulary)."""
    import numpy as np

    os.makedirs(folder, exist_ok=True)
    ids = np.random.default_rng(0).integers(0, vocab, n).astype(np.uint16)
    for split in ("train", "val"):
        ids.tofile(os.path.join(folder, f"{split}.bin"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["untied", "tied"])
def test_qwen2_init_from_at_tp2_pp2_and_export_round_trip(tmp_path, name):
    """--init_from=<Qwen2 folder> on TP=2 x PP=2 (grouped-query heads split over TP; the untied head, or
    the tied embedding's copy, on the last stage), learning rate 0: the set merged and exported is the
    folder's tensors bit for bit."""
    src = os.path.join(ROOT, "tests", "fixtures", f"hf_qwen2_{name}")
    _tiny_vocab_data(str(tmp_path / "data" / "tiny"), 300)
    out, exported = tmp_path / "run", tmp_path / "exported"
    shape = {"untied": ["--n_head=4", "--n_kv_head=2", "--tie_embeddings=False"], "tied": ["--n_head=4"]}[name]
    p = run(
        TINY
        + shape
        + [
            "--family=qwen2",
            "--vocab_size=300",
            "--intermediate_size=48",
            "--norm_eps=1e-6",
            "--rope_theta=1000.0",
            f"--data_dir={tmp_path / 'data'}",
            "--dataset=tiny",
            "--tp=2",
            "--pp=2",
            "--gradient_accumulation_steps=2",
            "--max_iters=1",
            "--eval_interval=0",
            "--learning_rate=0",
            "--min_lr=0",
            "--weight_decay=0",
            f"--init_from={src}",
            f"--out_dir={out}",
        ],
        nproc=4,
    )
    assert f"init_from: {src} (qwen2," in p.stdout
    subprocess.run(
        [sys.executable, "sample.py", "export", str(out), str(exported)], cwd=ROOT, check=True, capture_output=True
    )
    back, read = load_file(str(exported / "model.safetensors")), hf.Weights(src)
    assert len(back) == 2 + 12 * 2 + (name == "untied")  # embed, norm, 12 per block, the untied head
    for k, v in back.items():
        assert torch.equal(v, read(k)), k


def _tp2_greedy(rank, world, folder):
    mc = GPTConfig(vocab_size=50257, **MC)
    model = GPT(mc, comm_for(rank, world), seed=5).eval()
    os.makedirs(folder, exist_ok=True)
    cfg = config.Settings(**MC, tp=2).as_dict()
    sha = checkpoint.write_file(
        {"model": model.state_dict(), "config": cfg, "iter": 1, "layout": [2, 1], "run_id": "test"},
        os.path.join(folder, f"tp{rank}_pp0.pt"),
    )
    every = [None] * world
    dist.all_gather_object(every, (f"tp{rank}_pp0.pt", sha))
    if rank == 0:
        checkpoint.mark_complete(
            folder, {"iter": 1, "tp": 2, "pp": 1, "dp": 1, "zero1": False, "run_id": "test", "files": dict(every)}
        )
    idx = torch.tensor([[464, 3290, 318]])
    return generate(model, idx, 12, top_k=1, generator=torch.Generator().manual_seed(0))


def test_tp2_checkpoint_merged_gives_the_same_greedy_tokens(tmp_path):
    folder = str(tmp_path / "ckpt" / "iter_00000001")
    tp_tokens = run_ranks(_tp2_greedy, 2, folder)[0]
    import sample

    merged = sample.load(str(tmp_path))
    ones = generate(merged, torch.tensor([[464, 3290, 318]]), 12, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ones, tp_tokens)
    ref = GPT(GPTConfig(vocab_size=50257, **MC), seed=5)  # the same init at TP=1
    for k, v in ref.state_dict().items():
        assert torch.equal(merged.state_dict()[k], v), k


# --- data ---------------------------------------------------------------------------------------


def test_prepare_with_qwen2_tokenizer_writes_uint32_that_training_reads(tmp_path):
    """--tokenizer=qwen2: uint32 ids (Qwen2's ids pass 65535), meta.json says so, the loader and the
    launch checks read the dtype from it; a model whose vocabulary is too small is refused naming the file."""
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"d{i}.txt").write_text(f"Document {i}: 你好，世界. " * 30)
    subprocess.run(
        [
            sys.executable,
            "data/prepare.py",
            "--allow_short",
            "q",
            "--files",
            str(texts),
            "--val_fraction=0.34",
            "--tokenizer=qwen2",
            f"--out_root={tmp_path}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    import numpy as np

    from data.loader import Batches
    from data.tokenizer import get_encoding

    meta = json.load(open(tmp_path / "q" / "meta.json"))
    assert (meta["tokenizer"], meta["dtype"], meta["vocab_size"]) == ("qwen2", "uint32", 151646)
    val = np.fromfile(tmp_path / "q" / "val.bin", dtype=np.uint32)
    assert val.max() > 65535 and get_encoding("qwen2").decode(val.tolist()).startswith("Document 2: 你好")
    x, y = Batches(str(tmp_path / "q"), 8, 2, 0, 0, "cpu").get("val", 0)
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 151646
    windows = {tuple(val[i : i + 8].tolist()) for i in range(len(val) - 8)}  # a uint16 misread makes none of these
    assert all(tuple(row) in windows for row in x.tolist()), x
    c = config.parse(
        [f"--data_dir={tmp_path}", "--dataset=q", "--block_size=8", "--family=qwen2", "--vocab_size=151936"],
    )
    config.check(c, 1)
    with pytest.raises(config.ConfigError, match="outside the model's vocabulary of 50257: set --vocab_size"):
        config.check(dataclasses.replace(c, vocab_size=50257), 1)


def test_prepare_text_files_and_folders(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(4):
        (texts / f"d{i}.txt").write_text(f"Document number {i}. " * 20)
    subprocess.run(
        [
            sys.executable,
            "data/prepare.py",
            "--allow_short",
            "mine",
            "--files",
            str(texts),
            "--val_fraction=0.25",
            f"--out_root={tmp_path}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    meta = json.load(open(tmp_path / "mine" / "meta.json"))
    assert len(meta["train"]["documents"]) == 3 and meta["val"]["documents"] == [str(texts / "d3.txt")]
    import numpy as np

    from data.tokenizer import get_encoding

    val = np.fromfile(tmp_path / "mine" / "val.bin", dtype=np.uint16).tolist()
    assert get_encoding().decode(val) == "Document number 3. " * 19 + "Document number 3.<|endoftext|>"


def test_prepare_holds_out_text_even_from_few_files_and_leaves_nothing_when_it_fails(tmp_path):
    """Three files at the default 1%: no whole document is 1%, so the last one's tail is held out (never
    an empty val.bin). A prepare that fails (a binary file among the texts) leaves no folder behind."""
    from data import prepare

    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"d{i}.txt").write_text("\n\n".join(f"Paragraph {j} of document {i}." for j in range(200)))
    prepare.main(["mine", "--allow_short", "--files", *sorted(map(str, texts.iterdir())), f"--out_root={tmp_path}"])
    meta = json.load(open(tmp_path / "mine" / "meta.json"))
    assert meta["val"]["documents"] == [str(texts / "d2.txt") + " (end)"] and meta["val"]["tokens"] > 0
    assert meta["train"]["documents"] == [str(texts / f"d{i}.txt") for i in range(3)]
    (texts / "a_blob.txt").write_bytes(b"ELF\0" * 10)  # the first document: read while writing
    with pytest.raises(SystemExit, match="a binary file"):
        prepare.main(["other", "--allow_short", "--files", str(texts), f"--out_root={tmp_path}"])
    assert not (tmp_path / "other").exists() and not (tmp_path / "other.partial").exists()


def test_prepare_refuses_what_is_not_text_and_warns_on_what_is_not_utf8(tmp_path, capsys):
    from data import prepare

    with pytest.raises(SystemExit, match=f"{tmp_path / 'gone.txt'}: no such file or folder"):
        prepare.main(["mine", "--allow_short", "--files", str(tmp_path / "gone.txt"), f"--out_root={tmp_path}"])
    (tmp_path / "blob.txt").write_bytes(b"ELF\0\1\2" * 50)
    with pytest.raises(SystemExit, match="blob.txt: a binary file"):
        prepare.main(["mine", "--allow_short", "--files", str(tmp_path / "blob.txt"), f"--out_root={tmp_path}"])
    (tmp_path / "latin1.txt").write_bytes("Caf\xe9 cr\xe8me, na\xefve.\n\n".encode("latin-1") * 20)
    prepare.main(["mine", "--allow_short", "--files", str(tmp_path / "latin1.txt"), f"--out_root={tmp_path}"])
    assert "latin1.txt: 60 byte sequence(s) are not UTF-8, replaced by U+FFFD" in capsys.readouterr().err
    pytest.importorskip("datasets")
    with pytest.raises(SystemExit, match="no such folder"):
        prepare.main(["loc", "--allow_short", "--hf", str(tmp_path / "no_such_folder"), f"--out_root={tmp_path}"])


def test_prepare_a_local_hugging_face_dataset(tmp_path):
    pytest.importorskip("datasets")
    src = tmp_path / "corpus"
    src.mkdir()
    with open(src / "part.jsonl", "w") as f:
        for i in range(100):
            f.write(json.dumps({"body": f"Text {i}. " * (1 + i % 5), "id": i}) + "\n")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    subprocess.run(
        [
            sys.executable,
            "data/prepare.py",
            "--allow_short",
            "loc",
            "--hf",
            str(src),
            "--text_field=body",
            "--val_fraction=0.1",
            "--num_proc=2",
            f"--out_root={tmp_path}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env=env,
    )
    meta = json.load(open(tmp_path / "loc" / "meta.json"))
    assert (meta["train"]["documents"], meta["val"]["documents"]) == (90, 10)
    import numpy as np

    from data.tokenizer import EOT

    ids = np.concatenate([np.fromfile(tmp_path / "loc" / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    assert (ids == EOT).sum() == 100 and len(ids) == meta["train"]["tokens"] + meta["val"]["tokens"]


def test_train_finds_its_data_from_any_working_directory(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            *TINY,
            "--max_iters=1",
            "--eval_interval=0",
            f"--out_dir={tmp_path / 'out'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(ln) for ln in open(tmp_path / "out" / "log.jsonl")]
    assert rows[0]["config"]["max_iters"] == 1 and rows[1]["iter"] == 1  # the resolved config comes first
    assert "\r" not in p.stderr  # no progress bar in a redirected log


# --- two nodes on one machine -------------------------------------------------------------------


@pytest.mark.slow
def test_two_node_launch_tp_inside_pp_across(tmp_path):
    """Two torchrun launches as two nodes (2 ranks each, gloo, rendezvous on 127.0.0.1): TP=2 inside
    each node, PP=2 across them; trains a few steps."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={n}",
                "--nproc_per_node=2",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "train.py",
                *TINY,
                "--tp=2",
                "--pp=2",
                "--gradient_accumulation_steps=2",
                "--max_iters=3",
                "--eval_interval=0",
                "--tp_codec=hint8",
                "--taco_min_bytes=0",
                f"--out_dir={tmp_path}",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-2000:] + outs[1][-2000:]
    assert "grid: world 4 = dp 1 x pp 2 x tp 2" in outs[0]
    losses = [r["loss"] for r in map(json.loads, open(tmp_path / "log.jsonl")) if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_kernel_watch_loop_reruns_in_a_fresh_child_at_every_save(tmp_path):
    """python -m tests.test_kernels --watch: a round at once, another after each save of a source,
    each in a forked child (what a round does stays out of the watching process), a failure
    reported and the loop going on."""
    import threading
    import time

    from test_kernels import watch

    src, log = tmp_path / "k.cu", tmp_path / "rounds.txt"
    src.write_text("v0")
    state = {"in_parent": 0}

    def run(names):
        state["in_parent"] += 1  # lands in the child's copy only
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {src.read_text()} {names}\n")
        return 0 if src.read_text() != "v1" else 2  # the edit "v1" breaks a test

    def edit():
        for v in ("v1", "v2"):  # each save whole (a new file put in place)
            time.sleep(1.0)
            tmp = tmp_path / "k.cu.new"
            tmp.write_text(v)
            os.utime(tmp, ns=(time.time_ns(), time.time_ns() + 10**9 * int(v[1])))  # a new mtime each save
            os.replace(tmp, src)

    t = threading.Thread(target=edit)
    t.start()
    watch(["strided"], run=run, sources=[str(src)], poll=0.02, rounds=3)
    t.join()
    rounds = [line.split() for line in log.read_text().splitlines()]
    assert [r[1] for r in rounds] == ["v0", "v1", "v2"] and all(r[2] == "['strided']" for r in rounds)
    assert len({r[0] for r in rounds} | {str(os.getpid())}) == 4 and state["in_parent"] == 0


def _readme_demo():
    """Command 1 of the README's quick start (nproc, args) and the losses its expected output shows."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    nproc, args = re.search(r"torchrun --nproc_per_node=(\d+) train.py (\S+)\n", text).groups()
    shown = text.split("Expected output of command 1")[1].split("```")[1]
    return int(nproc), [args], shown


def _numbers(lines):
    timings = r"\|\s+[\d.]+ ms\s+\|\s+\d+ tok/s|\| eta \S+$"
    return [re.sub(timings, "", re.sub(r"^(step\s+\d+)/\d+", r"\1", ln)) for ln in lines]  # and the run's length


@pytest.mark.parametrize("steps", [10, pytest.param(200, marks=pytest.mark.slow)])
def test_the_readmes_demo_output_is_what_the_command_prints(tmp_path, steps):
    """The README's expected output of command 1 (its grid, model size and every loss line up to
    `steps`; timings aside) is what a run of that very command prints: the default tier runs the
    first 10 steps (the learning-rate schedule does not depend on max_iters), the slow tier all.
    The first 10 steps' lines bit for bit; later losses within 0.1, since CPUs with other vector units
    round the sums differently and 200 steps of training carry that (seen: step 200's loss 5.7329 and
    5.7061 on two machines)."""
    nproc, args, shown = _readme_demo()
    p = run(args + [f"--max_iters={steps}", f"--out_dir={tmp_path}", "--sample_tokens=0"], nproc=nproc)
    printed = p.stdout.splitlines()
    expect = [
        ln
        for ln in shown.splitlines()
        if ln.startswith(("grid:", "model:", "step"))
        and (not ln.startswith("step") or int(ln.split()[1].split("/")[0]) <= steps)
    ]
    assert len(expect) >= (3 if steps == 10 else 5)
    got = _numbers(printed)
    losses = lambda ln: [float(v) for v in re.findall(r"(?:loss|train|val)\s+([\d.]+)", ln)]
    for line in _numbers(expect):
        if not line.startswith("step") or int(line.split()[1]) <= 10:
            assert line in got, (line, [ln for ln in got if ln.startswith(line[:12])])
            continue
        kind = line.split("|")[1].split()[0]  # "loss" or "train"
        same = [ln for ln in got if ln.split("|")[0] == line.split("|")[0] and ln.split("|")[1].split()[0] == kind]
        assert len(same) == 1, (line, same)
        assert losses(same[0]) == pytest.approx(losses(line), abs=0.1) and losses(line), (line, same[0])


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--family=qwen2", "--vocab_size=151936"], r"of them the token embedding \(tied: also the LM head\)$"),
        (["--family=llama", "--tie_embeddings=False"], r"of them the token embedding, [\d.]+ M the LM head$"),
        (["--family=gpt2"], r"\(tied: also the LM head\), [\d.]+ M the learned positions$"),
    ],
)
def test_the_model_line_says_what_its_parameters_are(argv, words):
    """The banner's counts, each against the parameters of the model itself (built without storage)."""
    import runlog

    mc = config.parse(["configs/demo.py", *argv]).model_config()
    line = runlog.model_line(mc)
    with torch.device("meta"):
        model = GPT(mc, seed=None)
    total = sum(p.numel() for p in model.parameters())
    assert re.search(words, line), line
    assert line.startswith(f"model: {total / 1e6:.2f} M parameters, {model.wte.weight.numel() / 1e6:.2f} M of them")


def test_the_kernel_loop_imports_no_more_than_it_needs():
    """The kernel edit -> rerun loop's process imports taco, which does not pull in torch._dynamo
    (about 1.5 s; only the symmetric-memory transport and torch.compile need it); and
    taco.load_kernels builds nothing for a CPU device."""
    code = (
        "import sys, torch, taco, taco_ext; taco.load_kernels(['hint8'], 256, torch.device('cpu')); "
        "print('torch._dynamo' in sys.modules, taco_ext._EXT is None)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == ["False", "True"], r.stdout + r.stderr


@pytest.mark.skipif(torch.version.cuda is not None, reason="what a CPU build of torch answers")
@pytest.mark.parametrize(
    "cmd",
    [
        ["bench.py", "kernels"],
        ["bench.py", "overlap"],
        ["bench.py", "host"],
        ["bench.py", "hf", "configs/qwen2_5_0_5b.py"],
        ["bench.py", "fit", "configs/qwen2_5_0_5b.py", "80", "ours:34"],
        ["-m", "tests.test_kernels", "strided"],
        ["-m", "tests.test_kernels", "--watch", "strided"],
    ],
)
def test_every_gpu_route_says_what_is_missing_in_one_line(cmd):
    """On a CPU machine every GPU route ends before any build or CUDA call: exit 2, one line naming the
    CPU build of torch and the fix (taco_ext.require_gpu), never a traceback or a wait."""
    p = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=300)
    said = [ln for ln in p.stderr.splitlines() if "needs a CUDA GPU" in ln]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert len(said) == 1 and "is a CPU build: install a CUDA build of torch" in said[0], p.stderr[-2000:]


def test_the_gpu_check_names_each_missing_piece(monkeypatch):
    """taco_ext.gpu_missing, each answer: a CPU build, no visible GPU, no nvcc, an nvcc of another CUDA
    major version; --device=cuda is refused before launch through it."""
    import taco_ext

    monkeypatch.setattr(torch.version, "cuda", None)
    assert "is a CPU build" in taco_ext.gpu_missing()
    with pytest.raises(config.ConfigError, match="device='cuda': this torch .* is a CPU build.*or use --device=cpu"):
        config.check(config.parse(["--device=cuda"]), 1)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU is visible" in taco_ext.gpu_missing()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(taco_ext, "_nvcc_version", lambda: None)
    assert "no nvcc found" in taco_ext.gpu_missing() and taco_ext.gpu_missing(build=False) is None
    monkeypatch.setattr(taco_ext, "_nvcc_version", lambda: (12, 8))
    assert "nvcc is CUDA 12.8, torch is built for CUDA 13.0" in taco_ext.gpu_missing()
    monkeypatch.setattr(taco_ext, "_nvcc_version", lambda: (13, 0))
    assert taco_ext.gpu_missing() is None


def test_prepare_refuses_a_split_training_would_refuse_and_reads_utf16(tmp_path, capsys):
    """A split shorter than the training block and its targets (block_size + 2; for a dataset no config reads,
    train.py's 64: a small file's 1% tail, an empty file) is refused naming --val_fraction / --val_files,
    --block_size and --allow_short, and nothing is kept; --allow_short keeps it with a warning. UTF-16 and
    UTF-32 text with a byte-order mark is read as text (not as a binary file)."""
    from data import prepare

    text = "\n\n".join(f"Paragraph {j}: the quick brown fox, once more." for j in range(300))
    (tmp_path / "one.txt").write_text(text)
    with pytest.raises(
        SystemExit, match=r"val.bin holds .* tokens, fewer than block_size \+ 2 = 66 .*--val_fraction.* --allow_short"
    ):
        prepare.main(["mine", "--files", str(tmp_path / "one.txt"), f"--out_root={tmp_path}"])
    assert not (tmp_path / "mine").exists() and not (tmp_path / "mine.partial").exists()
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit, match="train.bin holds 1 tokens"):
        prepare.main(["mine", "--files", str(tmp_path / "empty.txt"), f"--out_root={tmp_path}"])
    prepare.main(["mine", "--allow_short", "--files", str(tmp_path / "one.txt"), f"--out_root={tmp_path}"])
    assert "warning: data/mine/val.bin holds" in capsys.readouterr().err
    utf8 = json.load(open(tmp_path / "mine" / "meta.json"))
    for encoding in ("utf-16", "utf-32"):
        (tmp_path / f"{encoding}.txt").write_text(text, encoding=encoding)  # Python writes the BOM
        prepare.main(
            [encoding, "--allow_short", "--files", str(tmp_path / f"{encoding}.txt"), f"--out_root={tmp_path}"]
        )
        meta = json.load(open(tmp_path / encoding / "meta.json"))
        assert (meta["train"]["tokens"], meta["val"]["tokens"]) == (utf8["train"]["tokens"], utf8["val"]["tokens"])


def test_tensorboard_events_hold_the_logs_records(tmp_path, monkeypatch):
    """--tensorboard=True: the event files in out_dir hold log.jsonl's numbers (loss, lr, gradient norm,
    tok/s, wire bytes at every logged step; the evaluation's losses under val/), a resumed run's too;
    without the package, refused before launch."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = TINY + ["--tp=2", "--eval_interval=4", "--tensorboard=True", f"--out_dir={tmp_path}"]
    run(args + ["--max_iters=4"], nproc=2)
    run(args + ["--max_iters=7", "--resume"], nproc=2)  # a second event file, the same folder
    ev = EventAccumulator(str(tmp_path)).Reload()
    rows = [json.loads(ln) for ln in open(tmp_path / "log.jsonl")]
    steps = [r for r in rows if "loss" in r]
    for key in ("loss", "lr", "grad_norm", "tok_s", "tp_wire_bytes"):
        got = {e.step: e.value for e in ev.Scalars(f"train/{key}")}
        assert got == pytest.approx({r["iter"]: r[key] for r in steps}, rel=1e-6), key
    assert [e.step for e in ev.Scalars("val/val_loss")] == [r["iter"] for r in rows if "val_loss" in r]
    assert all(r["grad_norm"] > 0 for r in steps)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else 1)
    with pytest.raises(config.ConfigError, match="tensorboard=True needs the tensorboard package: pip install"):
        config.check(config.parse(["--tensorboard=True"]), 1)


def test_tensorboard_after_a_resume_from_an_earlier_set_holds_each_step_once(tmp_path):
    """A run goes to step 3, then on to 6, then is resumed from its set at 3 to step 8, twice: the events
    hold every step once, the resumed run's where it retrained them (TensorBoard reads each event file's purge
    step: without it the steps ran 1...6, then 4...8 again)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    args = TINY + ["--eval_interval=0", "--log_interval=1", "--tensorboard=True", f"--out_dir={out}"]
    run(args + ["--max_iters=3"])
    at3 = tmp_path / "kept" / "ckpt" / "iter_00000003"
    shutil.copytree(out / "ckpt" / "iter_00000003", at3)  # a run keeps its newest set only
    run(args + ["--max_iters=6", "--resume"])
    for _ in range(2):
        run(args + ["--max_iters=8", "--ckpt_interval=-1", "--resume", f"--resume_from={at3}"])
    ev = EventAccumulator(str(out)).Reload()
    steps = [e.step for e in ev.Scalars("train/loss")]
    assert steps == list(range(1, 9)), steps
    last = [json.loads(ln) for ln in open(out / "log.jsonl")][-1]
    assert ev.Scalars("train/loss")[-1].value == pytest.approx(last["loss"], rel=1e-6)
