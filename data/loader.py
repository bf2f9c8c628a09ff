"""
Training batches from the token files that data/prepare.py writes (read through np.memmap): the dtype
meta.json beside them names (uint16, or uint32 past 65,536 ids), uint16 where there is no meta.json.
"""

import json
import os

import numpy as np
import torch

FULL_SCAN = 1 << 28  # files up to this many tokens get their largest id checked in full


def read_meta(folder):
    """A dataset's meta.json ({} where there is none). A file that is not JSON is named."""
    path = os.path.join(folder, "meta.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON ({e}): prepare the data again (data/prepare.py)") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is not the record data/prepare.py writes: prepare the data again")
    if isinstance(meta.get("tokenizer"), str):
        meta["tokenizer"] = meta["tokenizer"].split(" (")[0]  # older files: "gpt2 (tiktoken BPE ...)"
    return meta


def width_of(n_vocab):
    """The token files' dtype for a vocabulary of n_vocab ids."""
    return "uint16" if n_vocab <= 1 << 16 else "uint32"


def token_dtype(folder):
    """The dtype of a dataset's token files: meta.json's dtype; where a meta.json names none, the width its
    vocab_size or its tokenizer needs (uint32 past 65,536 ids); no meta.json at all: uint16 (nanoGPT's
    convention). A meta.json that names none of the three is refused: the width of its files is unknown."""
    meta = read_meta(folder)
    if "dtype" in meta:
        return meta["dtype"]
    path = os.path.join(folder, "meta.json")
    if not os.path.isfile(path):
        return "uint16"
    if isinstance(meta.get("vocab_size"), int):
        return width_of(meta["vocab_size"])
    name = meta.get("tokenizer")
    if isinstance(name, str) and name:
        from data.tokenizer import get_encoding

        try:
            return width_of(get_encoding(name).n_vocab)
        except (ValueError, OSError):
            pass
    raise ValueError(
        f"{path} names no dtype, vocab_size or known tokenizer, so the width of its token files (uint16 or "
        f'uint32) is unknown: add "dtype" to it, or prepare the data again (data/prepare.py writes it)'
    )


def check_tokens(folder, split, block_size, vocab_size):
    """The token file <folder>/<split>.bin checked against its meta.json before it is read: a dtype
    meta.json names (uint16 or uint32), a size that is its token count times the dtype's bytes (a file
    read with the wrong width is refused naming both), more than one block of tokens, every id below
    vocab_size (in full up to FULL_SCAN tokens, else 64 windows of 1M spread over the file). Without a
    meta.json the file is read as uint16, which cannot hold the ids of a vocabulary past 65,536. Raises
    ValueError naming the file and the fix; returns the token count."""
    path = os.path.join(folder, f"{split}.bin")
    if not os.path.exists(path):
        raise ValueError(f"{path} is missing")
    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a file of tokens (a folder?)")
    meta = read_meta(folder)
    dtype = token_dtype(folder)
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"{os.path.join(folder, 'meta.json')}: dtype {dtype!r} (token files are uint16 or uint32)")
    if not os.path.isfile(os.path.join(folder, "meta.json")) and vocab_size > 1 << 16:
        raise ValueError(
            f"{folder} has no meta.json, so its ids would be read as uint16, which cannot hold a vocabulary of "
            f"{vocab_size}: prepare the data with data/prepare.py (it writes meta.json)"
        )
    size, width = os.path.getsize(path), np.dtype(dtype).itemsize
    count = (meta.get(split) or {}).get("tokens")
    if count is not None and size != count * width:
        other = "uint32" if dtype == "uint16" else "uint16"
        fits = size == count * np.dtype(other).itemsize
        raise ValueError(
            f"{path} has {size} bytes, but meta.json says {count} tokens of {dtype} ({count * width} bytes)"
            + (f": the file holds {other} ids; meta.json's dtype is wrong" if fits else ": the file was changed")
            + "; prepare the data again"
        )
    if size % width:
        raise ValueError(f"{path} has {size} bytes, not a whole number of {dtype} tokens")
    n = size // width
    if n < block_size + 2:
        raise ValueError(
            f"{path} holds {n} tokens, fewer than block_size + 2 = {block_size + 2}: "
            f"use a smaller --block_size or more text (data/prepare.py --val_fraction or --val_files for val.bin)"
        )
    data = np.memmap(path, dtype=dtype, mode="r")
    if n <= FULL_SCAN:
        top = int(data.max())
    else:
        top = max(int(data[s : s + (1 << 20)].max()) for s in np.linspace(0, n - (1 << 20), 64).astype(np.int64))
    if top >= vocab_size:
        raise ValueError(
            f"{path} holds token id {top}, outside the model's vocabulary of {vocab_size}: "
            f"set --vocab_size above it (Qwen2's tokenizer: 151936), or prepare the data with the "
            f"model's tokenizer (--tokenizer)"
        )
    return n


class Batches:
    """Random windows from a memmap of token ids. Stateless: the batch for (iteration, micro-step,
    dp rank) is a pure function of the seed, so resuming from a checkpoint is bit-exact. DP rank d
    of D takes the global micro-batches d, D + d, 2D + d, ...: one rank with D times the
    micro-steps sees exactly the same samples (what the parity tests compare)."""

    def __init__(self, folder, block_size, batch_size, seed, dp_rank, device, dp=1):
        dtype = token_dtype(folder)
        self.data = {s: np.memmap(os.path.join(folder, f"{s}.bin"), dtype=dtype, mode="r") for s in ("train", "val")}
        self.T, self.B, self.seed, self.dp_rank, self.dp, self.device = (
            block_size,
            batch_size,
            seed,
            dp_rank,
            dp,
            device,
        )

    def get(self, split, it, micro=0):
        data = self.data[split]
        g = micro * self.dp + self.dp_rank  # the global micro-batch index
        key = (((self.seed * 1_000_003 + (split == "val")) * 1_000_003 + it) * 1009 + g) * 1009
        g = torch.Generator().manual_seed(key % 2**62)
        ix = torch.randint(len(data) - self.T - 1, (self.B,), generator=g).tolist()
        x = torch.stack([torch.from_numpy(data[i : i + self.T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + self.T].astype(np.int64)) for i in ix])
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
