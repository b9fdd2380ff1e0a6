"""TEMPORARY text source used until the tokenized data pipeline lands.

Byte-level tokens (ids 0..255) from the Python standard library's own sources, which exist on every
machine, sampled as random windows with a seeded generator. It exists so the training loop can show
a falling loss before data/ has its real tokenizer and indexed datasets.
"""
from __future__ import annotations

import pathlib
import sysconfig

import numpy as np
import torch


class TemporaryStdlibBytes:
    def __init__(self, seq_len: int, max_bytes: int = 4_000_000, seed: int = 0):
        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for path in sorted(root.glob("*.py")):
            blob = path.read_bytes()
            chunks.append(blob)
            total += len(blob)
            if total >= max_bytes:
                break
        self.tokens = torch.from_numpy(np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.int64))
        self.seq_len = seq_len
        self.seed = seed

    def batch(self, step: int, micro: int, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(hash((self.seed, step, micro, rank)) & 0x7FFFFFFF)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (batch_size,), generator=gen)
        rows = torch.stack([self.tokens[s: s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]
