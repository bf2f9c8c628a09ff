"""The Llama, Qwen3 and Mistral families (and SmolLM2, a Llama with a tokenizer of its own) from Hugging Face
folders: transformers' logits at TP=1, TP=2 and PP=2, its greedy tokens, an export that the same class
loads to the same logits, the tokenizers, and the folders refused naming why
(fixtures: tests/make_families_fixture.py)."""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoint
import config
import hf
import parallel
import sample
from data.tokenizer import FolderTokenizer, get_encoding, save_hf
from launcher import run_ranks
from model import GPT
from sample import full_logits, generate
from test_cli import _tiny_vocab_data
from test_parallel import comm_for
from test_train import run as run_train

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
NAMES = ("llama_tied", "llama_untied", "qwen3", "mistral", "smollm2")
CLASSES = {"llama_tied": "LlamaForCausalLM", "llama_untied": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "mistral": "MistralForCausalLM", "smollm2": "LlamaForCausalLM"}  # fmt: skip
MIXED = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n  1234567 + 89 = ?\tnaïve café Ünïcödé "
    "\u4e2d\u6587 \U0001f600 e\u0301 it's don't aaaaaaaaaaaaaaaaaaaaaaaa ......      x\n\n\n   "
)
IDX = torch.tensor([[1, 5, 9, 2, 7]])


def folder(name):
    return os.path.join(FIXTURES, f"hf_{name}")


def expected(name):
    return torch.load(os.path.join(FIXTURES, "hf_families_expected.pt"), weights_only=False)[name]


def rel_err(ours, ref):
    return ((ours[..., : ref.shape[-1]] - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("name", NAMES)
def test_folder_gives_hf_logits_and_greedy_tokens(name):
    """Each family's folder read as its parts: llama3-scaled rotary positions (every wavelength band at 40
    tokens), q/k-norm and an explicit head size (Qwen3), tied and untied heads, both forms of config.json's
    rotary settings; logits within 1e-5 of transformers', the same 8 greedy tokens."""
    ex, model = expected(name), sample.load(folder(name))
    with torch.no_grad():
        logits, _ = model(ex["idx"], all_positions=True)
    assert rel_err(logits, ex["logits"]) <= 1e-5
    got = generate(model, ex["greedy"][:, :5], 8, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(got, ex["greedy"])
    mc = model.config
    parts = {"llama_tied": ("llama", "llama3", True), "llama_untied": ("llama", "llama3", False),
             "qwen3": ("qwen3", "", True), "mistral": ("mistral", "", False), "smollm2": ("llama", "", True)}  # fmt: skip
    assert (mc.family, mc.rope_scaling, mc.tie_embeddings) == parts[name]
    assert (mc.head_dim, mc.qk_norm) == ((16, True) if name == "qwen3" else (8, False))


def _layouts(rank, world):
    """Every folder at TP=2 (its slices only) and staged over PP=2: the last position's logits."""
    out = {}
    for name in NAMES:
        mc, idx = hf.model_config(folder(name)), expected(name)["idx"]
        tp = GPT(mc, comm_for(rank, world), seed=None).eval()
        hf.load_into(tp, folder(name))
        out[f"{name} tp2"] = full_logits(tp, idx)
    grid = parallel.init_grid(tp=1, pp=2)
    for name in NAMES:
        mc, idx = hf.model_config(folder(name)), expected(name)["idx"]
        pp = GPT(mc, seed=None, stage=grid.pp_rank, stages=2).eval()
        hf.load_into(pp, folder(name))
        with torch.no_grad():
            out[f"{name} pp2"] = full_logits(pp, idx, grid)
    return out


def test_families_at_tp2_and_pp2_give_hf_logits():
    for rank, out in enumerate(run_ranks(_layouts, 2)):
        for key, logits in out.items():
            if logits is None:  # the first pipeline stage has no logits
                assert rank == 0 and key.endswith("pp2")
                continue
            ref = expected(key.split()[0])["logits"][:, -1, :]
            assert rel_err(logits, ref) <= 1e-5, key


@pytest.mark.parametrize("name", NAMES)
def test_export_loads_in_the_same_class_to_the_same_logits(tmp_path, name):
    """sample.py export: every tensor bit for bit, config.json that the family's transformers class reads
    (the folder's context kept, not a training block size), its logits those of the source folder; a
    folder's own tokenizer goes with it."""
    transformers = pytest.importorskip("transformers")
    dest = tmp_path / "out"
    sample.cli(["export", folder(name), str(dest)])
    src, back = hf.Weights(folder(name)), hf.Weights(str(dest))
    assert set(back.where) == set(src.where)
    for k in src.where:
        assert torch.equal(back(k), src(k)), k
    cfg = json.load(open(dest / "config.json"))
    assert cfg["architectures"] == [CLASSES[name]] and cfg["max_position_embeddings"] == 64
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(dest)).eval()
    assert type(theirs).__name__ == CLASSES[name]
    ex = expected(name)
    with torch.no_grad():
        assert rel_err(theirs(ex["idx"]).logits, ex["logits"]) <= 1e-6
    assert hf.model_config(str(dest)) == hf.model_config(folder(name))
    assert os.path.isfile(dest / "tokenizer.json") == (name == "smollm2")


def test_llama3_tokenizer_from_the_llama_models_ranks(tmp_path):
    """Llama 3's tokenizer, built with tiktoken from llama-models' ranks file: its ids, its specials; the
    tokenizer.json an export writes gives the same ids through transformers' AutoTokenizer, and decodes."""
    transformers = pytest.importorskip("transformers")
    enc = get_encoding("llama3")
    assert enc.encode_ordinary("Hello world") == [9906, 1917]
    assert enc.n_vocab == 128256 and enc.eot_token == 128001
    assert enc.encode("<|begin_of_text|>", allowed_special="all") == [128000]
    assert enc.encode_ordinary("1234567") == [4513, 10961, 22]  # digits in runs of up to three
    assert enc.decode(enc.encode_ordinary(MIXED)) == MIXED
    save_hf("llama3", str(tmp_path), 131072)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = enc.encode_ordinary(MIXED)
    assert tok(MIXED, add_special_tokens=False)["input_ids"] == ids and tok.decode(ids) == MIXED
    assert tok.eos_token == "<|end_of_text|>" and tok.model_max_length == 131072


def test_a_folders_tokenizer_json_gives_autotokenizers_ids():
    """SmolLM2-style: the folder's tokenizer.json read with the tokenizers library; ids equal to
    AutoTokenizer's on a mixed text, the end of a document its eos token; special tokens' text inside a
    document is ordinary text (as tiktoken's encode_ordinary), where AutoTokenizer makes it the special id."""
    transformers = pytest.importorskip("transformers")
    enc, tok = get_encoding(folder("smollm2")), transformers.AutoTokenizer.from_pretrained(folder("smollm2"))
    assert isinstance(enc, FolderTokenizer) and enc.eot_token == 0 and enc.n_vocab == 300
    assert enc.encode_ordinary(MIXED) == tok(MIXED, add_special_tokens=False)["input_ids"]
    assert enc.decode(enc.encode_ordinary(MIXED)) == tok.decode(tok(MIXED)["input_ids"])
    assert 0 not in enc.encode_ordinary("a<|endoftext|>b") and 0 in tok("a<|endoftext|>b")["input_ids"]


def _edited(tmp_path, name, edit):
    d = tmp_path / "hf"
    shutil.copytree(folder(name), d)
    c = json.load(open(d / "config.json"))
    edit(c)
    json.dump(c, open(d / "config.json", "w"))
    return str(d)


@pytest.mark.parametrize(
    "name, edit, message",
    [
        ("mistral", lambda c: c.update(sliding_window=16), "a sliding window of 16 tokens, shorter than its context"),
        ("qwen3", lambda c: c.update(use_sliding_window=True), "sliding-window attention"),
        ("llama_tied", lambda c: c.update(attention_bias=True), "biases on the attention"),
        ("llama_tied", lambda c: c.update(mlp_bias=True), "biases on the MLP"),
        ("llama_tied", lambda c: c.update(hidden_act="gelu"), "the activation 'gelu'"),
        ("llama_tied", lambda c: c["rope_parameters"].update(rope_type="yarn"), "rotary scaling 'yarn' is not built"),
        (
            "llama_tied",
            lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
            "rope_parameters says 'llama3' and rope_scaling says 'dynamic'",
        ),
        ("llama_tied", lambda c: c["rope_parameters"].pop("low_freq_factor"), "lacks low_freq_factor"),
        ("qwen3", lambda c: c.pop("hidden_size"), "has no 'hidden_size' (the model's n_embd)"),
    ],
)
def test_folders_the_family_cannot_build_are_refused_naming_why(tmp_path, name, edit, message):
    with pytest.raises(SystemExit) as e:
        sample.cli(["generate", _edited(tmp_path, name, edit), "--tokens=1"])
    assert message in str(e.value)


def test_init_from_takes_the_folders_model_and_refuses_a_flag_that_disagrees():
    """--init_from: family, shape and parts from config.json; an explicit setting that disagrees is
    refused naming both values; the training context may be shorter than the folder's."""
    cfg = config.parse([f"--init_from={folder('qwen3')}", "--block_size=32"])
    config.take_init_from(cfg)
    mc = cfg.model_config()
    assert (mc.family, mc.head_dim, mc.qk_norm, mc.n_kv_head, mc.max_positions) == ("qwen3", 16, True, 2, 64)
    with pytest.raises(config.ConfigError, match=r"head_dim=8 \(the folder's: 16\)"):
        config.take_init_from(config.parse([f"--init_from={folder('qwen3')}", "--head_dim=8"]))
    with pytest.raises(config.ConfigError, match="block_size=128 is more than the 64 positions"):
        config.take_init_from(config.parse([f"--init_from={folder('qwen3')}", "--block_size=128"]))


def test_a_qwen3_checkpoint_merges_into_the_folders_model(tmp_path):
    """A Qwen3 model's state dict through the full-model names (q/k-norm replicated, not split)."""
    model = sample.load(folder("qwen3"))
    full = dict(model.state_dict())
    assert "h.0.attn.q_norm.weight" in full and full["h.0.attn.q_norm.weight"].shape == (16,)
    again = GPT(model.config, seed=None)
    checkpoint.shard_into(again, full.__getitem__)
    for k, v in again.state_dict().items():
        assert torch.equal(v, full[k]), k


@pytest.mark.parametrize(
    "path, world, layout, params",
    [
        ("configs/llama3_2_1b.py", 8, ["--tp=8"], 1235.8),
        ("configs/llama3_2_1b.py", 4, ["--tp=2", "--pp=2"], 1235.8),
        ("configs/qwen3_0_6b.py", 8, ["--tp=4", "--pp=2", "--eval_iters=8"], 596.0),
        ("configs/smollm2_135m.py", 3, [], 134.5),
    ],
)
def test_family_configs_are_real_shapes_that_pass_the_launch_checks(path, world, layout, params, monkeypatch):
    """The configs' shapes are the models' (parameter counts as published: 1.24B, 0.6B, 135M) and their
    layouts pass the checks before launch (the small dataset standing in, read as the model's on purpose;
    the memory an 80 GiB GPU's, as they are meant for)."""
    monkeypatch.setattr(config, "memory_here", lambda cfg, ranks: (80 * 2**30, "an H100's memory"))
    cfg = config.parse([path, *layout, "--device=cpu", "--dataset=small", "--tokenizer=gpt2", "--vocab_size=50257"])
    config.check(cfg, world)
    assert config.parse([path]).model_config().num_params(False) / 1e6 == pytest.approx(params, abs=0.05)


def test_export_refuses_a_model_its_class_cannot_hold_in_one_line(tmp_path):
    """A Qwen2 model without its q/k/v biases is no Qwen2ForCausalLM: refused naming the part, no
    folder (finished or partial) left behind."""
    cfg = config.parse(["--family=qwen2", "--qkv_bias=False", "--vocab_size=64", "--n_layer=1", "--n_embd=16"])
    model = GPT(cfg.model_config(), seed=0)
    with pytest.raises(SystemExit, match=r"^run: Qwen2ForCausalLM cannot hold this model: it has qkv_bias=False$"):
        sample.export(model, "", str(tmp_path / "out"), overwrite=False, source="run")
    assert os.listdir(tmp_path) == []


def test_export_replaces_a_model_folder_only_when_told_and_wholly(tmp_path, monkeypatch):
    """Export into a folder that holds another model: refused without --overwrite; with it, the old
    shard index and shards go (loaders prefer an index, so a stale one would load the old weights), the
    folder's other files stay, and the folder loads to the exported model's logits. A read-only folder
    and a destination that is a file are refused in one line."""
    dest = tmp_path / "dest"
    dest.mkdir()
    old = hf.Weights(folder("llama_untied"))  # another model, stored as two shards and an index
    names = sorted(old.where)
    half = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in half.items():
        save_file({k: old(k).contiguous() for k in keys}, str(dest / shard))
    index = {"metadata": {}, "weight_map": {k: s for s, keys in half.items() for k in keys}}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(os.path.join(folder("llama_untied"), "config.json"), dest / "config.json")
    (dest / "README.md").write_text("my notes")
    src = folder("qwen2_tied")
    with pytest.raises(SystemExit, match="is not empty .* --overwrite replaces the model there"):
        sample.cli(["export", src, str(dest)])
    with torch.no_grad():  # untouched
        assert torch.equal(
            full_logits(sample.load(str(dest)), IDX), full_logits(sample.load(folder("llama_untied")), IDX)
        )
    sample.cli(["export", src, str(dest), "--overwrite"])
    assert sorted(os.listdir(dest)) == ["README.md", "config.json", "model.safetensors"]
    assert (dest / "README.md").read_text() == "my notes" and not os.path.exists(str(dest) + ".partial")
    with torch.no_grad():
        assert torch.equal(full_logits(sample.load(str(dest)), IDX), full_logits(sample.load(src), IDX))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as a user without write permission sees it
    with pytest.raises(SystemExit, match="cannot export: permission denied"):
        sample.cli(["export", src, str(dest), "--overwrite"])


@pytest.mark.parametrize(
    "change, said",
    [
        (dict(num_key_value_heads=3), "n_head=4 is not a multiple of n_kv_head=3"),
        (dict(head_dim=7), "the head size head_dim = 7 must be even"),
    ],
)
def test_generate_refuses_a_folder_whose_heads_cannot_be_built(tmp_path, change, said):
    """sample.py reads a folder through the checks training makes (config.check_model): one line."""
    src = tmp_path / "hf"
    shutil.copytree(folder("qwen3"), src)
    c = json.load(open(src / "config.json"))
    json.dump(dict(c, **change), open(src / "config.json", "w"))
    with pytest.raises(SystemExit, match=re.escape(said)):
        sample.cli(["generate", str(src), "--tokens=2"])


def _integer_weights(d):
    w = load_file(os.path.join(d, "model.safetensors"))
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"].to(torch.int32)
    save_file(w, os.path.join(d, "model.safetensors"))


def _cut(keep):
    def cut(d):
        p = os.path.join(d, "model.safetensors")
        data = open(p, "rb").read()
        open(p, "wb").write(data[: keep(len(data))])

    return cut


def _fewer_layers(d):
    c = json.load(open(os.path.join(d, "config.json")))
    json.dump(dict(c, num_hidden_layers=1), open(os.path.join(d, "config.json"), "w"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (_integer_weights, "model.embed_tokens.weight is stored as torch.int32: quantized weights are not read here"),
        (_cut(lambda n: n - 100), "model.safetensors is not a readable safetensors file"),  # short data
        (_cut(lambda n: 2), "model.safetensors is not a readable safetensors file"),  # short header
        (_fewer_layers, "config.json says 1 layers, the weights hold 2"),
    ],
)
def test_damaged_weights_are_refused_in_one_line_on_both_routes(tmp_path, damage, message):
    """Integer weights, a truncated safetensors file, a config.json with fewer layers than the weights:
    sample.py and --init_from each end in one line naming the file, never a traceback or a half load."""
    d = tmp_path / "hf"
    shutil.copytree(folder("llama_tied"), d)
    damage(str(d))
    with pytest.raises(SystemExit, match=re.escape(message)):
        sample.cli(["generate", str(d), "--tokens=1"])
    _tiny_vocab_data(str(tmp_path / "tiny"), 300)  # no meta.json: any tokenizer's ids
    train_args = [f"--init_from={d}", "--dataset=tiny", f"--data_dir={tmp_path}", "--block_size=32", "--batch_size=2"]
    p = run_train(train_args + ["--max_iters=1", "--device=cpu", f"--out_dir={tmp_path / 'out'}"], check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Traceback" not in out and message in out, out[-2000:]
