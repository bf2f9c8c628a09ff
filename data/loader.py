"""
Training batches from the token files that data/prepare.py writes (read through np.memmap): uint16
ids, or the dtype meta.json beside them names (uint32 for Qwen2's vocabulary).
"""

import json
import os

import numpy as np
import torch

FULL_SCAN = 1 << 28  # files up to this many tokens get their largest id checked in full


def read_meta(folder):
    """A dataset's meta.json (tokenizer, dtype), defaulting to GPT-2's uint16 where there is none."""
    path = os.path.join(folder, "meta.json")
    meta = {}
    if os.path.isfile(path):
        with open(path) as f:
            meta = json.load(f)
    meta.setdefault("tokenizer", "gpt2")
    meta["tokenizer"] = meta["tokenizer"].split()[0]  # older files: "gpt2 (tiktoken BPE ...)"
    meta.setdefault("dtype", "uint16")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise ValueError(f"{path}: dtype {meta['dtype']!r} (token files are uint16 or uint32)")
    return meta


def check_tokens(path, block_size, vocab_size, dtype="uint16"):
    """Raise ValueError naming the file and the fix unless it holds whole tokens of dtype, more
    than one block of them, all below vocab_size (the largest id: in full up to FULL_SCAN tokens,
    else in 64 windows of 1M spread over the file). Returns the token count."""
    if not os.path.exists(path):
        raise ValueError(f"{path} is missing")
    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a file of tokens (a folder?)")
    size, width = os.path.getsize(path), np.dtype(dtype).itemsize
    if size % width:
        raise ValueError(f"{path} has {size} bytes, not a whole number of {dtype} tokens")
    n = size // width
    if n < block_size + 2:
        raise ValueError(
            f"{path} holds {n} tokens, fewer than block_size + 2 = {block_size + 2}: "
            f"use a smaller --block_size or more text"
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
        dtype = read_meta(folder)["dtype"]
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
