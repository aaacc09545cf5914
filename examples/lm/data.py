"""The corpus and its batches: bytes of a public-domain novel (see data/README.md), byte tokens.

Batches are a pure function of (seed, step): a resumed run sees exactly the batches the
uninterrupted run would have seen, which is what makes "save, kill, resume" reproducible.
"""
from __future__ import annotations

import pathlib

import numpy as np

CORPUS = pathlib.Path(__file__).parent / "data" / "persuasion.txt"
VOCAB = 256  # byte-level tokens


def load_tokens(path: pathlib.Path = CORPUS, val_fraction: float = 0.05):
    """(train, val) uint8 token arrays; the last `val_fraction` of the text is held out."""
    data = np.frombuffer(pathlib.Path(path).read_bytes(), dtype=np.uint8)
    cut = int(len(data) * (1.0 - val_fraction))
    return data[:cut], data[cut:]


def batch(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int = 0):
    """Random windows ``[batch_size, seq_len + 1]`` int32 (inputs are [:, :-1], targets [:, 1:])."""
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"corpus of {len(tokens)} tokens is too short for seq_len {seq_len}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return tokens[idx].astype(np.int32)


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
