"""
Text out of a model: generation (also across TP ranks and pipeline stages: train.py prints a
sample at the end of a run), and the command line for checkpoints and weights:

    python sample.py generate out/demo --prompt "ROMEO:" --tokens 200 --temperature 0.8 --top_k 100
    python sample.py generate path/to/qwen2.5-0.5b          # a Hugging Face folder of any family here
    python sample.py export out/demo hf_out/                # a checkpoint as a Hugging Face folder

A checkpoint of any (tp, pp) layout is merged into one model on one process (checkpoint.merge).
"""

import argparse
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.nn.functional as F

import checkpoint
import config
import hf
from data.loader import read_meta
from model import FAMILIES, GPT


def full_logits(model, idx, grid=None):
    """Last-position logits over the whole vocabulary (gathered over TP): for sampling only.
    With pipeline stages every stage calls it: the context runs through the stages in turn
    (blocking send/recv to the neighbours, grid's convention); non-last stages return None."""
    if model.stages == 1:
        logits, _ = model(idx)
    else:
        h = None
        if not model.first:
            h = torch.empty(*idx.shape, model.config.n_embd, device=idx.device)
            dist.recv(h, grid.rank - grid.tp)
        logits, _ = model(idx if model.first else None, None, h)
        if not model.last:
            dist.send(logits.float().contiguous(), grid.rank + grid.tp)
            return None
    logits = logits[:, -1, :].float().contiguous()  # (B, V/tp)
    if model.comm.size > 1:
        parts = [torch.empty_like(logits) for _ in range(model.comm.size)]
        dist.all_gather(parts, logits, group=model.comm.group)
        logits = torch.cat(parts, dim=-1)
    return logits[:, : model.config.vocab_size]


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None, grid=None):
    """Sample tokens. Under TP every rank must call this with the same idx and an identically
    seeded generator (all ranks take part in every forward and must draw the same token).
    With pipeline stages (pass the grid) every stage calls it; the last stage draws the token
    and broadcasts it to the other stages of its pipeline."""
    assert not model.comm.sp, "sampling with sequence parallelism is not implemented"
    for _ in range(max_new_tokens):
        ctx = idx[:, -model.config.block_size :]
        logits = full_logits(model, ctx, grid)
        nxt = torch.empty(idx.shape[0], 1, dtype=idx.dtype, device=idx.device)
        if model.last:
            logits = logits / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
                logits[logits < v[:, [-1]]] = float("-inf")
            nxt = torch.multinomial(F.softmax(logits, dim=-1).cpu(), 1, generator=generator).to(idx.device)
        if model.stages > 1:
            dist.broadcast(nxt, src=grid.last_stage_rank, group=grid.pp_group)
        idx = torch.cat((idx, nxt), dim=1)
    return idx


def print_sample(model, prompt, tokens, grid, seed, autocast, tokenizer="gpt2"):
    """Every rank of the model generates (all take part in each forward); rank 0 prints the text."""
    if model.comm.sp:
        if grid.rank == 0:
            print("(no sample: generation is not implemented with sequence parallelism)")
        return
    from data.tokenizer import get_encoding

    enc, dev = get_encoding(tokenizer), next(model.parameters()).device
    model.eval()
    idx = torch.tensor([enc.encode_ordinary(prompt)], device=dev)
    gen = torch.Generator().manual_seed(seed)  # identical on every TP rank
    with autocast:
        out = generate(model, idx, tokens, temperature=0.8, top_k=100, generator=gen, grid=grid)
    if grid.rank == 0:
        print("sample:\n" + enc.decode(out[0].tolist()))


def load(path, device="cpu"):
    """A single-process model from an out_dir (its newest complete checkpoint set), a set's folder,
    or a Hugging Face folder (config.json beside the weights)."""
    return load_with_tokenizer(path, device)[0]


def load_with_tokenizer(path, device="cpu"):
    """(model, the name of the tokenizer its ids are in): a folder's own tokenizer.json, else the one
    its run trained on (a checkpoint's settings, or its data's meta.json), else its family's."""
    if os.path.exists(os.path.join(path, "config.json")):
        mc = hf.model_config(path)
        config.check_model(mc)
        model = GPT(mc, seed=None)
        read = hf.Weights(path)
        hf.check_weights(read, mc, path)
        checkpoint.shard_into(model, hf.from_hf(read, mc))
        run = None
    else:
        found = [path] if os.path.exists(os.path.join(path, "COMPLETE")) else checkpoint.sets(path)
        if not found:
            raise SystemExit(f"{path}: no complete checkpoint set (ckpt/iter_N/COMPLETE), no Hugging Face config.json")
        mc, full, run = checkpoint.merge(found[-1])
        model = GPT(mc, seed=None)
        model.load_state_dict(full)
    return model.to(device).eval(), tokenizer_of(path, mc, run)


def tokenizer_of(path, mc, run):
    """The tokenizer of a model loaded from path (run: its run's settings, None for a Hugging Face folder). A
    folder without tokenizer.json reads its family's tokenizer only where its vocabulary holds that tokenizer's
    ids (Qwen2's is padded past them); otherwise None: no tokenizer known here (a SmolLM2 folder, 49,152 ids,
    decoded with Llama 3's tokenizer would print other words), which generate refuses and export says."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    if run is None:
        from data.tokenizer import get_encoding

        family = FAMILIES[mc.family].tokenizer
        return family if family and mc.vocab_size >= get_encoding(family).n_vocab else None
    if run.get("tokenizer"):
        return run["tokenizer"]
    try:  # a run of an earlier version: its data says
        return read_meta(config.data_dir(config.Settings(dataset=run["dataset"], data_dir=run["data_dir"])))[
            "tokenizer"
        ]
    except (KeyError, OSError, ValueError):
        return FAMILIES[mc.family].tokenizer


MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model.bin.index.json", "generation_config.json")  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def export(model, tokenizer, dest, overwrite, source):
    """model as a Hugging Face folder dest (its weights, config.json and, where the model's vocabulary
    holds it, its tokenizer's files). The folder is written beside dest (dest.partial) and renamed into
    place whole: a folder that held another model is replaced only with overwrite, and its other files
    (a README, say) are kept while every model and tokenizer file of the old model goes (a stale shard
    index would make loaders read the old weights). OS errors in one line."""
    from safetensors import SafetensorError

    from data.tokenizer import get_encoding, save_hf

    dest = os.path.abspath(dest)
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise SystemExit(f"{dest} is a file: export writes a folder (model.safetensors, config.json); choose another")
    old = os.listdir(dest) if os.path.isdir(dest) else []
    if old and not overwrite:
        raise SystemExit(f"{dest} is not empty ({', '.join(sorted(old)[:4])}...): --overwrite replaces the model there "
                         f"(its weights, index, config and tokenizer files; other files stay), or choose an empty folder")  # fmt: skip
    if old and not os.access(dest, os.W_OK):
        raise SystemExit(f"{dest}: cannot export: permission denied (a read-only folder): choose another")
    covered = bool(tokenizer) and model.config.vocab_size >= get_encoding(tokenizer).n_vocab
    partial = dest + ".partial"
    moved = []  # the old folder's other files, once in partial: then partial is not removed on a failure
    try:
        with checkpoint.os_errors(dest, "export"):
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            hf.save(model, partial)
            if covered:  # AutoTokenizer.from_pretrained(dest) reads these
                save_hf(tokenizer, partial, model.config.max_positions)
            stale = re.compile(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)$")
            for f in old:  # the old folder's other files come along
                if f not in MODEL_FILES + TOKENIZER_FILES and not stale.match(f):
                    shutil.move(os.path.join(dest, f), os.path.join(partial, f))
                    moved.append(f)
            if old:
                os.rename(dest, dest + ".old")
            os.rename(partial, dest)
            shutil.rmtree(dest + ".old", ignore_errors=True)
    except ValueError as e:  # a model the family's class cannot hold
        raise SystemExit(f"{source}: {e}") from None
    except SafetensorError as e:  # safetensors' own error for what the OS refused (a full disk)
        raise SystemExit(f"{dest}: cannot export: the weights could not be written ({e}): free space, or choose "
                         f"another folder (the model that was there is kept)") from None  # fmt: skip
    finally:  # whatever ended the export, no half-written folder stays beside dest (unless it holds its files)
        if not moved:
            shutil.rmtree(partial, ignore_errors=True)
    print(
        f"wrote {dest}/model.safetensors and config.json ({model.config.family})"
        + (
            f", and {tokenizer}'s tokenizer files"
            if covered
            else f"; no tokenizer: a vocabulary of {model.config.vocab_size} is no tokenizer's here"
        )
    )
    if covered and model.config.family == "qwen2" and tokenizer != "qwen2":
        print(f"note: transformers 5's AutoTokenizer reads every qwen2 folder with Qwen2's own tokenizer class, "
              f"whatever tokenizer_config.json names: read {tokenizer}'s ids with "
              f"PreTrainedTokenizerFast.from_pretrained({dest!r}) (its tokenizer.json)")  # fmt: skip


def cli(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="sample text from a checkpoint or Hugging Face weights")
    g.add_argument("path", help="an out_dir, a checkpoint set folder, or a Hugging Face folder")
    g.add_argument("--prompt", default="\n")
    g.add_argument("--tokens", type=int, default=200, help="new tokens per sample")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top_k", type=int, default=200, help="0: the whole vocabulary; 1: greedy")
    g.add_argument("--num_samples", type=int, default=1)
    g.add_argument("--seed", type=int, default=1337)
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    e = sub.add_parser("export", help="write a model as a Hugging Face folder")
    e.add_argument("path", help="anything generate reads: an out_dir, a checkpoint set, a Hugging Face folder")
    e.add_argument("dest", help="folder for model.safetensors and config.json (from_pretrained reads it)")
    e.add_argument("--overwrite", action="store_true", help="replace the model in a folder that holds one")
    a = ap.parse_args(argv)
    try:
        model, name = load_with_tokenizer(a.path, a.device if a.cmd == "generate" else "cpu")
    except (ValueError, config.ConfigError) as e:  # a folder that is not what it should be
        raise SystemExit(f"{a.path}: {e}") from None
    if a.cmd == "export":
        export(model, name, a.dest, a.overwrite, a.path)
        return
    if a.temperature <= 0 or a.tokens < 0 or a.top_k < 0:
        raise SystemExit("--temperature must be > 0, --tokens and --top_k >= 0")
    from data.tokenizer import get_encoding

    if name is None:
        raise SystemExit(
            f"{a.path} has no tokenizer.json, and its vocabulary of {model.config.vocab_size} is not that of its "
            f"family's tokenizer here: copy the model's tokenizer.json (and tokenizer_config.json) into it"
        )
    try:
        enc = get_encoding(name)
    except (ValueError, OSError) as e:
        raise SystemExit(f"{a.path}: its tokenizer ({name}) cannot be read: {e}") from None
    ids = enc.encode_ordinary(a.prompt)
    if max(ids, default=0) >= model.config.vocab_size:
        raise SystemExit(
            f"the prompt's token ids reach {max(ids)}, past the model's vocabulary of "
            f"{model.config.vocab_size} ({enc.name}'s tokenizer): a prompt of other words, or the model's data"
        )
    idx = torch.tensor([ids] * a.num_samples, device=a.device)
    gen = torch.Generator().manual_seed(a.seed)
    out = generate(model, idx, a.tokens, a.temperature, a.top_k or None, gen)
    print("\n---------------\n".join(enc.decode(row) for row in out.tolist()))  # a line between samples


if __name__ == "__main__":
    cli()
