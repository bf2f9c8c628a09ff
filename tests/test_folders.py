"""Hugging Face folders as users hand them over: loaded as transformers loads them, or refused in one line naming
why, the same way through every route (sample.py generate and export, --init_from)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import config
import hf
import sample

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def _copy(tmp_path, name, edit=None, drop=()):
    d = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), d)
    if edit:
        c = json.load(open(d / "config.json"))
        edit(c)
        json.dump(c, open(d / "config.json", "w"))
    for f in drop:
        os.remove(d / f)
    return str(d)


def test_a_tied_config_over_a_head_of_its_own_loads_as_transformers_loads_it(tmp_path):
    """config.json says tie_word_embeddings, the weights hold an lm_head.weight that is not the embedding:
    transformers keeps the file's head (and warns); so do generate, export and --init_from (the logits were
    2.57 relative apart, and the export dropped the file's head)."""
    transformers = pytest.importorskip("transformers")
    d = _copy(tmp_path, "hf_llama_tied")
    sd = load_file(os.path.join(d, "model.safetensors"))
    sd["lm_head.weight"] = torch.randn(
        sd["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(0)
    )
    save_file(sd, os.path.join(d, "model.safetensors"), {"format": "pt"})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    idx = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(idx).logits
        ours = sample.load(d)
        got = ours(idx, all_positions=True)[0][..., :300]
        assert not ours.config.tie_embeddings
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        sample.export(ours, None, str(tmp_path / "out"), False, d)  # the export keeps the file's head
        again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        torch.testing.assert_close(again(idx).logits, want, rtol=1e-5, atol=1e-5)
    c = config.parse([f"--init_from={d}"])
    config.take_init_from(c)
    assert c.tie_embeddings is False


@pytest.mark.parametrize(
    "rope, said",
    [
        (dict(low_freq_factor=8.0), "rope_high_freq=4.0 must be > rope_low_freq=8.0"),
        (dict(factor=0.0), "rope_factor=0.0 must be > 0"),
    ],
)
def test_llama3_rotary_settings_are_checked_alike_on_every_route(tmp_path, rope, said):
    """A Llama 3 folder whose rotary scaling cannot be right is refused by generate and export as by
    --init_from, with the same words (the first loaded 1.3e-2 off transformers, the second gave NaN logits)."""
    d = _copy(tmp_path, "hf_llama_untied", edit=lambda c: c["rope_scaling"].update(rope))
    for route in (["generate", d, "--tokens=2"], ["export", d, str(tmp_path / "out")]):
        with pytest.raises(SystemExit, match=said):
            sample.cli(route)
    with pytest.raises(config.ConfigError, match=said):
        config.check(config.parse([f"--init_from={d}", "--tokenizer=gpt2", "--vocab_size=300"]), 1)


@pytest.mark.parametrize(
    "name, edit, drop, said",
    [
        ("hf_smollm2", None, ("tokenizer.json",), "has no tokenizer.json, and its vocabulary of 300"),
        ("hf_mistral", None, (), "has no tokenizer.json, and its vocabulary of 300"),
        ("hf_smollm2", lambda c: c.update(num_hidden_layers="2"), (), "num_hidden_layers is '2', not an integer"),
        (
            "hf_llama_untied",
            lambda c: c["rope_scaling"].update(factor="32"),
            (),
            "the rotary scaling's factor is '32', not a number",
        ),
    ],
)
def test_generate_refuses_a_folder_it_cannot_read_in_one_line(tmp_path, capsys, name, edit, drop, said):
    """No tokenizer.json where the family's tokenizer is not the folder's (SmolLM2, Mistral), numbers written
    as strings: one line naming the folder and the fix (it decoded with Llama 3's tokenizer without a word, or
    ended in a traceback)."""
    d = _copy(tmp_path, name, edit, drop)
    with pytest.raises(SystemExit, match=said) as e:
        sample.cli(["generate", d, "--tokens=2"])
    assert "\n" not in str(e.value)


def test_a_tokenizer_json_that_is_not_json_is_named(tmp_path):
    d = _copy(tmp_path, "hf_smollm2")
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        f.write("this is no JSON")
    with pytest.raises(SystemExit, match="tokenizer.json is not a tokenizer.json the tokenizers library reads"):
        sample.cli(["generate", d, "--tokens=2"])


def test_export_edges_end_in_one_line_and_keep_what_was_there(tmp_path, monkeypatch):
    """Exporting into a path under a file, and an --overwrite whose weights cannot be written (a full disk):
    one line each; the model already at dest is kept and no dest.partial is left behind."""
    src = os.path.join(FIXTURES, "hf_smollm2")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(SystemExit, match="a part of the path is a file, not a folder"):
        sample.cli(["export", src, str(tmp_path / "a_file" / "sub")])
    dest = tmp_path / "dest"
    sample.cli(["export", src, str(dest)])
    before = {f: open(dest / f, "rb").read() for f in os.listdir(dest)}

    def full_disk(*args, **kw):
        from safetensors import SafetensorError

        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    with pytest.raises(SystemExit, match="cannot export: the weights could not be written") as e:
        sample.cli(["export", src, str(dest), "--overwrite"])
    assert "\n" not in str(e.value)
    assert {f: open(dest / f, "rb").read() for f in os.listdir(dest)} == before
    assert not os.path.exists(str(dest) + ".partial")
    assert hf.model_config(str(dest)).n_layer == 2
