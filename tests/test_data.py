"""What a user's data may hold and how data/prepare.py treats what is already there: the width of token files
whose meta.json does not say it, a split too short for the block the user trains with (the same floor as
training's), a dataset of another tokenizer never replaced without being told, and a refused prepare that leaves
the dataset under its name as it was."""

import hashlib
import json
import os

import numpy as np
import pytest
import torch

import config
import sample
from data import prepare
from data.loader import Batches, token_dtype

TEXT = "\n\n".join(f"Paragraph {j}: the quick brown fox jumps over the lazy dog, once more." for j in range(400))


def _dataset(folder, ids, meta):
    os.makedirs(folder)
    for split in ("train", "val"):
        ids.tofile(os.path.join(folder, f"{split}.bin"))
    if meta is not None:
        with open(os.path.join(folder, "meta.json"), "w") as f:
            json.dump(meta, f)


@pytest.mark.parametrize(
    "meta, dtype",
    [({"tokenizer": "qwen2"}, np.uint32), ({"vocab_size": 151936}, np.uint32), ({"tokenizer": "gpt2"}, np.uint16)],
)
def test_a_meta_json_without_a_dtype_reads_the_width_its_tokenizer_needs(tmp_path, meta, dtype):
    """Token files beside a meta.json that names no dtype and no token counts: the batches hold the file's
    ids (uint32 ids read as uint16 were other tokens: the step-1 loss was 11.919, not 11.934)."""
    ids = (np.arange(3000) % 5000 + (70000 if dtype == np.uint32 else 100)).astype(dtype)
    _dataset(tmp_path / "d", ids, meta)
    assert token_dtype(str(tmp_path / "d")) == np.dtype(dtype).name
    x, y = Batches(str(tmp_path / "d"), 16, 4, 0, 0, torch.device("cpu")).get("train", 0, 0)
    assert set(x.flatten().tolist()) <= set(ids.tolist()) and x.min() >= ids.min()
    c = config.parse([f"--data_dir={tmp_path}", "--dataset=d", "--block_size=16", "--vocab_size=151936"])
    if dtype == np.uint32:
        c.family, c.tokenizer = "qwen2", "qwen2"
    config.check(c, 1)  # the files' sizes and ids agree with the width


@pytest.mark.parametrize("meta", [{}, {"note": "made by hand"}, {"tokenizer": "no_such_tokenizer"}])
def test_a_meta_json_that_cannot_tell_its_width_is_refused(tmp_path, meta):
    """An empty meta.json, or one that names no dtype, vocab_size or known tokenizer, is refused naming the
    file (an empty one was reported as missing)."""
    _dataset(tmp_path / "d", np.arange(3000, dtype=np.uint32), meta)
    c = config.parse([f"--data_dir={tmp_path}", "--dataset=d", "--block_size=16"])
    with pytest.raises(config.ConfigError, match="names no dtype, vocab_size or known tokenizer") as e:
        config.check(c, 1)
    assert str(tmp_path / "d" / "meta.json") in str(e.value) and "has no meta.json" not in str(e.value)


def test_prepare_holds_a_split_to_the_block_size_training_needs(tmp_path):
    """The floor is training's own, block_size + 2 tokens, for the block size the user names: a split that
    training would refuse is refused, one it takes is written (the floor was 1,025 for every block size)."""
    (tmp_path / "t.txt").write_text(TEXT)
    argv = ["mine", "--files", str(tmp_path / "t.txt"), f"--out_root={tmp_path}", "--val_fraction=0.02"]
    prepare.main(argv + ["--block_size=64"])
    val = json.load(open(tmp_path / "mine" / "meta.json"))["val"]["tokens"]
    with pytest.raises(SystemExit, match=rf"fewer than block_size \+ 2 = {val + 1}.* --block_size=N"):
        prepare.main(argv + [f"--block_size={val - 1}", "--overwrite"])
    prepare.main(argv + [f"--block_size={val - 2}", "--overwrite"])  # exactly training's floor
    c = config.parse([f"--data_dir={tmp_path}", "--dataset=mine", f"--block_size={val - 2}"])
    config.check(c, 1)
    c = config.parse([f"--data_dir={tmp_path}", "--dataset=mine", f"--block_size={val - 1}"])
    with pytest.raises(config.ConfigError, match="fewer than block_size"):
        config.check(c, 1)


def test_prepare_defaults_to_the_block_size_of_the_configs_that_read_the_dataset():
    assert prepare.default_block_size("small") == 64  # configs/demo.py, train.py's default
    assert prepare.default_block_size("large") == 2048  # configs/gpt1b.py, the largest that reads it
    assert prepare.default_block_size("my_own_text") == prepare.TRAIN_DEFAULT_BLOCK == config.Settings().block_size


def _digest(folder):
    return {f: hashlib.sha256(open(os.path.join(folder, f), "rb").read()).hexdigest() for f in os.listdir(folder)}


def test_a_refused_prepare_leaves_the_dataset_under_its_name_as_it_was(tmp_path):
    """A prepare refused for a short split, for text that is no text, or for another tokenizer's name: the
    dataset already there is byte for byte what it was, and no partial folder is left."""
    (tmp_path / "t.txt").write_text(TEXT)
    (tmp_path / "short.txt").write_text("A few words.")
    (tmp_path / "blob.txt").write_bytes(b"ELF\0" * 10)
    prepare.main(["mine", "--files", str(tmp_path / "t.txt"), f"--out_root={tmp_path}", "--block_size=16"])
    before = _digest(tmp_path / "mine")
    for files, extra, said in (
        ("short.txt", [], "fewer than block_size"),
        ("blob.txt", [], "a binary file"),
        ("t.txt", ["--tokenizer=qwen2"], "holds gpt2 tokens and this would replace them with qwen2's"),
    ):
        with pytest.raises(SystemExit, match=said):
            prepare.main(["mine", "--files", str(tmp_path / files), f"--out_root={tmp_path}", *extra])
        assert _digest(tmp_path / "mine") == before and not (tmp_path / "mine.partial").exists()
    prepare.main(
        ["mine", "--files", str(tmp_path / "t.txt"), f"--out_root={tmp_path}", "--tokenizer=qwen2", "--overwrite"]
    )
    assert json.load(open(tmp_path / "mine" / "meta.json"))["tokenizer"] == "qwen2"


def test_prepare_says_what_is_wrong_with_an_empty_files_list(tmp_path):
    with pytest.raises(SystemExit, match="--files names no file"):
        prepare.main(["x5", "--files", f"--out_root={tmp_path}"])


def test_data_of_another_family_is_refused_once_naming_every_setting_together(tmp_path):
    """Own text prepared with Llama 3's tokenizer, trained with the defaults (a GPT-2): one refusal that names
    --family=llama and the vocabulary together, and the data to prepare instead (it took two refusals, the first
    citing Qwen2's tokenizer, and neither named the family); with those two settings the data is taken."""
    ids = (np.arange(4000) * 31 % 128000).astype(np.uint32)
    _dataset(tmp_path / "mine", ids, {"tokenizer": "llama3", "dtype": "uint32"})
    with pytest.raises(config.ConfigError) as e:
        config.check(config.parse([f"--data_dir={tmp_path}", "--dataset=mine"]), 1)
    said = str(e.value)
    assert "holds llama3 tokens" in said and "--family=llama --vocab_size=128256" in said, said
    assert "python data/prepare.py mine --files <your text>" in said and "Qwen2" not in said
    config.check(config.parse([f"--data_dir={tmp_path}", "--dataset=mine", "--family=llama", "--vocab_size=128256"]), 1)


@pytest.mark.parametrize(
    "name", ["hf_llama_tied", pytest.param("hf_qwen2_untied", marks=pytest.mark.slow),
             pytest.param("hf_qwen3", marks=pytest.mark.slow), pytest.param("hf_smollm2", marks=pytest.mark.slow)],
)  # fmt: skip
def test_the_readmes_cpu_fine_tune_is_one_command_for_each_family(tmp_path, name):
    """configs/finetune_cpu.py and --init_from are the whole recipe: the folder fills every model setting (no
    config file of its shape, no guessed flags); data in the folder's tokenizer (here ids it holds, with the
    meta.json prepare.py writes) is all the rest."""
    from data.tokenizer import identity
    from launcher import launch

    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", name)
    tok = (
        folder
        if os.path.isfile(os.path.join(folder, "tokenizer.json"))
        else {"hf_llama_tied": "llama3"}.get(name, "qwen2")
    )
    ids = (np.arange(3000) * 7 % 250).astype(np.uint16)
    _dataset(tmp_path / "ft", ids, {"tokenizer": tok, "tokenizer_id": identity(tok), "dtype": "uint16"})
    args = ["configs/finetune_cpu.py", f"--init_from={folder}", f"--data_dir={tmp_path}", "--dataset=ft"]
    p = launch("train.py", args + ["--block_size=16", "--max_iters=4", "--eval_interval=0", "--sample_tokens=0",
                                   f"--out_dir={tmp_path / 'out'}"], 1)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    losses = [json.loads(ln)["loss"] for ln in open(tmp_path / "out" / "log.jsonl") if '"loss"' in ln]
    x, y = Batches(str(tmp_path / "ft"), 16, 4, config.Settings().seed, 0, torch.device("cpu")).get("train", 0, 0)
    with torch.no_grad():  # step 1 trained the folder's own model: its loss on the first batch
        first = sample.load(folder)(x, y)[1].item()
    assert losses[0] == pytest.approx(first, rel=1e-5) and all(np.isfinite(losses))
