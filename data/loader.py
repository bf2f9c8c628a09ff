"""
Training batches from the uint16 token files that data/prepare.py writes (read through np.memmap).
"""
import os

import numpy as np
import torch


class Batches:
    """Random windows from a uint16 memmap. Stateless: the batch for (iteration, micro-step,
    dp rank) is a pure function of the seed, so resuming from a checkpoint is bit-exact. DP rank d
    of D takes the global micro-batches d, D + d, 2D + d, ...: one rank with D times the
    micro-steps sees exactly the same samples (what the parity tests compare)."""

    def __init__(self, dataset, block_size, batch_size, seed, dp_rank, device, dp=1):
        self.data = {s: np.memmap(os.path.join("data", dataset, f"{s}.bin"), dtype=np.uint16, mode="r")
                     for s in ("train", "val")}
        self.T, self.B, self.seed, self.dp_rank, self.dp, self.device = block_size, batch_size, seed, dp_rank, dp, device

    def get(self, split, it, micro=0):
        data = self.data[split]
        g = micro * self.dp + self.dp_rank                        # the global micro-batch index
        key = (((self.seed * 1_000_003 + (split == "val")) * 1_000_003 + it) * 1009 + g) * 1009
        g = torch.Generator().manual_seed(key % 2 ** 62)
        ix = torch.randint(len(data) - self.T - 1, (self.B,), generator=g).tolist()
        x = torch.stack([torch.from_numpy(data[i:i + self.T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + self.T].astype(np.int64)) for i in ix])
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
