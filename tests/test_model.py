"""sample.py and the tokenizer: Hugging Face weights in and out (GPT-2, Qwen2), generation."""

import json
import os
import shutil
import unicodedata

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import hf
import sample
from data.tokenizer import get_encoding
from launcher import run_ranks
from model import GPT, GPTConfig
from sample import full_logits, generate
from test_parallel import comm_for

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FIXTURE = os.path.join(FIXTURES, "hf_gpt2_tiny.pt")
QWEN = {name: os.path.join(FIXTURES, f"hf_qwen2_{name}") for name in ("untied", "tied")}


def from_hf_state_dict(sd, config, comm=None):
    model = GPT(config, comm, seed=None)
    checkpoint.shard_into(model, hf.from_hf(sd.__getitem__, config))
    return model


def qwen_expected(name):
    return torch.load(os.path.join(FIXTURES, "hf_qwen2_expected.pt"), weights_only=False)[name]


def test_tokenizer_gives_gpt2_ids():
    enc = get_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257
    text = "O Romeo, Romeo! wherefore art thou Romeo?"
    assert enc.decode(enc.encode(text)) == text


def test_qwen2_tokenizer_gives_qwen2_ids():
    """Qwen2's BPE from qwen-agent's ranks file: its ids, the special tokens after the 151,643 ranks,
    NFC normalisation, digits one at a time, a lossless round trip."""
    enc = get_encoding("qwen2")
    assert enc.encode("Hello world") == [9707, 1879]
    assert enc.n_vocab == 151646 and enc.eot_token == 151643
    assert enc.encode("<|im_start|>", allowed_special="all") == [151644]
    assert enc.encode("2024") == [enc.encode(d)[0] for d in "2024"]
    assert enc.encode("cafe\u0301") == enc.encode("caf\u00e9")  # NFC, as Qwen2's tokenizer.json
    text = "O Romeo, Romeo! 你好，世界\n\n\tcode(x) = 42;"
    assert enc.decode(enc.encode(text)) == text
    with pytest.raises(ValueError, match="tokenizer .llama.: choose one of gpt2, qwen2, llama3, or a folder"):
        get_encoding("llama")


def test_hf_state_dict_gives_hf_logits():
    fx = torch.load(FIXTURE, weights_only=False)
    model = from_hf_state_dict(fx["state_dict"], GPTConfig(**fx["config"])).eval()
    idx, ref = fx["idx"], fx["logits"]
    with torch.no_grad():
        logits, _ = model(idx, all_positions=True)
    # our head is padded to a multiple of 128 columns; the first 300 must be Hugging Face's logits
    torch.testing.assert_close(logits[..., :300], ref, rtol=1e-4, atol=1e-5)


def _hf_tp(rank, world):
    fx = torch.load(FIXTURE, weights_only=False)
    model = from_hf_state_dict(fx["state_dict"], GPTConfig(**fx["config"]), comm_for(rank, world)).eval()
    out = {"gpt2": (full_logits(model, fx["idx"]), fx["logits"][:, -1, :])}
    for name, folder in QWEN.items():  # each rank reads only its slices' tensors
        mc = hf.model_config(folder)
        q = GPT(mc, comm_for(rank, world), seed=None).eval()
        checkpoint.shard_into(q, hf.from_hf(hf.Weights(folder), mc))
        out[name] = (full_logits(q, qwen_expected(name)["idx"]), qwen_expected(name)["logits"][:, -1, :])
    return out


def test_hf_weights_sliced_for_tp2_give_hf_logits():
    """GPT-2 and both Qwen2 folders at TP=2: every rank's slice of the fused QKV (unequal q, k, v
    sections under grouped-query attention) and of [gate|up]; the gathered logits are Hugging Face's."""
    for out in run_ranks(_hf_tp, 2):
        for name, (ours, ref) in out.items():
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_qwen2_folder_gives_hf_logits_and_greedy_tokens(name):
    """A Qwen2ForCausalLM folder (model.safetensors with a 5.x config; sharded safetensors with its index
    and a 4.x config): logits within 1e-5 of Hugging Face's, the same 8 greedy tokens."""
    ex, model = qwen_expected(name), sample.load(QWEN[name])
    assert model.config.family == "qwen2" and model.config.tie_embeddings == (name == "tied")
    assert model.config.rope_theta == 1000.0 and model.config.norm_eps == 1e-6
    with torch.no_grad():
        logits, _ = model(ex["idx"], all_positions=True)
    ref = ex["logits"]
    assert ((logits[..., :300] - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    prompt = ex["greedy"][:, :5]
    assert torch.equal(generate(model, prompt, 8, top_k=1, generator=torch.Generator().manual_seed(0)), ex["greedy"])


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_qwen2_export_then_load_is_exact(tmp_path, name):
    """sample.py export of a Qwen2 folder writes every Hugging Face tensor bit for bit (a tied head is not
    written, as Hugging Face saves it) and a config that reads back as the same model."""
    dest = tmp_path / "out"
    sample.cli(["export", QWEN[name], str(dest)])
    src = hf.Weights(QWEN[name])
    back = load_file(str(dest / "model.safetensors"))
    index = os.path.join(QWEN[name], "model.safetensors.index.json")
    names = (
        json.load(open(index))["weight_map"]
        if os.path.exists(index)
        else load_file(os.path.join(QWEN[name], "model.safetensors"))
    )
    assert set(back) == set(names)
    for k in names:
        assert torch.equal(back[k], src(k)), k
    assert hf.model_config(str(dest)) == hf.model_config(QWEN[name])


@pytest.mark.parametrize(
    "family, vocab, tokenizer", [("gpt2", 50257, "gpt2"), ("qwen2", 151936, "qwen2"), ("qwen2", 50304, "gpt2")]
)
def test_export_writes_the_tokenizer_that_autotokenizer_reads(tmp_path, capsys, family, vocab, tokenizer):
    """An exported folder holds its tokenizer: Hugging Face reads it and gives our tokenizer's ids for the
    same text (English, digits, accents, CJK, emoji, runs of spaces and of one letter) and decodes them
    back to that text (Qwen2: NFC-normalised, as its tokenizer is). A document's own "<|endoftext|>" is
    ordinary text to us and the special token to Hugging Face unless split_special_tokens. A Qwen2-shaped
    model on GPT-2 tokens: transformers 5 gives every qwen2 folder Qwen2's class, so the export names
    PreTrainedTokenizerFast, which reads its tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    dest = str(tmp_path / "dest")
    model = GPT(GPTConfig(family=family, vocab_size=vocab, n_layer=1, n_head=2, n_embd=16, block_size=32), seed=0)
    sample.export(model, tokenizer, dest, overwrite=False, source="test")
    assert {"tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"} <= set(os.listdir(dest))
    mixed = tokenizer != family
    assert ("PreTrainedTokenizerFast.from_pretrained" in capsys.readouterr().out) == mixed
    text = (
        "First Citizen:\nBefore we proceed any further, hear me speak.\n\n  1234567 + 89 = ?\tnaïve café "
        "Ünïcödé \u4e2d\u6587 \U0001f600 e\u0301 it's don't " + "a" * 40 + " " + "x" * 33 + "!!!!!!!!!!!!"
    )
    enc = get_encoding(tokenizer)
    ids, eot = enc.encode_ordinary(text), enc.eot_token
    classes = [transformers.PreTrainedTokenizerFast] + ([] if mixed else [transformers.AutoTokenizer])
    for cls in classes:
        tok = cls.from_pretrained(dest)
        assert tok(text)["input_ids"] == ids, (cls, type(tok))
        assert tok.decode(ids) == (text if tokenizer == "gpt2" else unicodedata.normalize("NFC", text))
        doc = "a<|endoftext|>b"
        assert eot not in enc.encode_ordinary(doc) and eot in tok(doc)["input_ids"]
        assert tok(doc, split_special_tokens=True)["input_ids"] == enc.encode_ordinary(doc)
        assert tok.model_max_length == 32 and (
            cls is transformers.PreTrainedTokenizerFast or tok.eos_token == "<|endoftext|>"
        )


def test_pytorch_model_bin_reads_like_safetensors(tmp_path):
    torch.save(load_file(os.path.join(QWEN["untied"], "model.safetensors")), tmp_path / "pytorch_model.bin")
    shutil.copy(os.path.join(QWEN["untied"], "config.json"), tmp_path)
    a, b = sample.load(QWEN["untied"]), sample.load(str(tmp_path))
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v), k


def _folder(tmp_path, edit=None, drop=None):
    """A copy of the sharded Qwen2 fixture with config.json edited and/or a file removed."""
    d = tmp_path / "hf"
    shutil.copytree(QWEN["tied"], d)
    if edit:
        c = json.load(open(d / "config.json"))
        edit(c)
        json.dump(c, open(d / "config.json", "w"))
    if drop:
        os.remove(d / drop)
    return str(d)


@pytest.mark.parametrize(
    "edit, drop, message",
    [
        (
            lambda c: c.update(model_type="gemma"),
            None,
            "model_type 'gemma' is not supported; the families read are gpt2, qwen2, llama, qwen3, mistral",
        ),
        (
            lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            None,
            "rotary scaling 'yarn' is not built here (default and llama3 are)",
        ),
        (lambda c: c.update(use_sliding_window=True), None, "sliding-window attention"),
        (None, "model-00003-of-00005.safetensors", "model-00003-of-00005.safetensors is missing"),
        (lambda c: c.update(intermediate_size=40), None, "does not fit this model"),
        (lambda c: c.update(num_hidden_layers=3), None, "config.json says 3 layers, the weights hold 2"),
        (None, "config.json", "no Hugging Face config.json"),
    ],
)
def test_bad_hf_folders_are_refused_naming_why(tmp_path, edit, drop, message):
    with pytest.raises((ValueError, SystemExit)) as e:
        sample.load(_folder(tmp_path, edit, drop))
    assert message in str(e.value)


def test_generate_is_deterministic_and_in_vocabulary():
    model = GPT(GPTConfig(block_size=8, vocab_size=200, n_layer=1, n_head=2, n_embd=16)).eval()
    idx = torch.zeros(1, 1, dtype=torch.long)
    a = generate(model, idx, 20, generator=torch.Generator().manual_seed(0))
    b = generate(model, idx, 20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (1, 21)
    assert int(a.max()) < 200  # never a padding id (vocab padded to 256)
