"""Data that ships or is generated: nothing is downloaded at run time.

    tokens = byte_tokens(synthetic_text(50_000, seed=0))  # a generated toy language, as bytes
    for x, y in batches(tokens, batch_size=8, seq_len=64, seed=0, n_batches=100): ...
    d = digits()                                          # sklearn's 8x8 digits, split

Text sources:
* :func:`synthetic_text` — sentences of a small generated language (agreement,
  adjectives, counting). It depends only on the seed (Python's ``random.random``
  is guaranteed stable across Python versions), so every machine sees the same bytes.
* :func:`zen_text` — the Zen of Python, decoded from the ``this`` module (ships
  with every Python, unchanged for decades; 857 bytes: enough to memorise).
* :func:`python_source_text` — the source of standard-library modules read from
  disk: real text, but the bytes change between Python releases.

Tokens are bytes (vocabulary 256): no tokenizer to download, and any text works.
"""
from __future__ import annotations

import importlib
import inspect
import random
from typing import NamedTuple

import torch

# ----------------------------------------------------------------------------- text


def zen_text() -> str:
    """The Zen of Python (``import this`` prints it; the module stores it rot13-encoded)."""
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the poem
        this = importlib.import_module("this")
    return codecs.decode(this.s, "rot13") + "\n"


def python_source_text(modules=("textwrap", "string", "bisect", "heapq")) -> str:
    """Source code of standard-library modules (varies with the Python version)."""
    return "".join(inspect.getsource(importlib.import_module(m)) for m in modules)


_NOUNS = ["cat", "dog", "bird", "fox", "owl", "frog", "bee", "duck"]
_VERBS = ["see", "chase", "like", "follow", "help", "watch"]
_ADJS = ["small", "big", "red", "green", "quick", "lazy", "old", "young"]
_NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def synthetic_text(n_chars: int = 50_000, seed: int = 0) -> str:
    """Sentences of a toy language, at least ``n_chars`` characters, deterministic in ``seed``.

    Learnable structure at several scales: spelling, articles and adjectives, subject-verb
    agreement ("the cat sees" / "the cats see") and counting runs ("one two three .").
    """
    if n_chars < 1:
        raise ValueError(f"n_chars must be >= 1, got {n_chars}")
    rng = random.Random(seed)

    def pick(options):  # only random() is guaranteed stable across Python versions
        return options[int(rng.random() * len(options))]

    def noun_phrase():
        plural = rng.random() < 0.4
        adj = pick(_ADJS) + " " if rng.random() < 0.5 else ""
        return f"the {adj}{pick(_NOUNS)}{'s' if plural else ''}", plural

    parts, size = [], 0
    while size < n_chars:
        if rng.random() < 0.15:
            start = int(rng.random() * 6)
            sentence = " ".join(_NUMBERS[start:start + 3 + int(rng.random() * 4)]) + " ."
        else:
            subject, plural = noun_phrase()
            obj, _ = noun_phrase()
            verb = pick(_VERBS)
            verb = verb if plural else verb + ("es" if verb.endswith(("ch", "sh")) else "s")
            sentence = f"{subject} {verb} {obj} ."
        parts.append(sentence)
        size += len(sentence) + 1
    return "\n".join(parts)[:n_chars]


def byte_tokens(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as an int64 tensor (vocabulary 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens) -> str:
    """Inverse of :func:`byte_tokens` (invalid UTF-8 shown as U+FFFD)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def train_val_split(tokens: torch.Tensor, val_fraction: float = 0.1):
    """First (1 - val_fraction) of the stream for training, the rest for validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


# ----------------------------------------------------------------------------- batches


def batches(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0, n_batches: int | None = None):
    """Yield ``(x, y)`` of shape (batch_size, seq_len): random windows, y = x shifted by one.

    The windows depend only on ``seed``: every rank that calls this with the same seed
    sees the same *global* batch and keeps its own rows (``x[rank::world]`` or a
    contiguous slice), which is what makes a data-parallel step comparable with the
    single-device step. ``n_batches=None`` yields forever.
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    if len(tokens) < seq_len + 1:
        raise ValueError(f"a stream of {len(tokens)} tokens is too short for seq_len={seq_len} "
                         f"(needs at least seq_len + 1)")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    produced = 0
    while n_batches is None or produced < n_batches:
        starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=gen)
        windows = tokens[starts[:, None] + offsets]  # (batch, seq + 1)
        yield windows[:, :-1], windows[:, 1:]
        produced += 1


# ----------------------------------------------------------------------------- digits


class Digits(NamedTuple):
    x_train: torch.Tensor  # (n_train, 1, 8, 8) float32 in [0, 1]
    y_train: torch.Tensor  # (n_train,) int64 in 0..9
    x_test: torch.Tensor
    y_test: torch.Tensor


def digits(test_fraction: float = 0.25, seed: int = 0) -> Digits:
    """scikit-learn's 1797 handwritten 8x8 digits (shipped inside the package), shuffled
    with ``seed`` and split into train and test."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - requirements.txt installs it
        raise ImportError("digits() needs scikit-learn: pip install scikit-learn") from exc
    raw = load_digits()
    x = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values 0..16
    y = torch.tensor(raw.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Digits(x[train], y[train], x[test], y[test])


__all__ = ["zen_text", "python_source_text", "synthetic_text", "byte_tokens", "decode",
           "train_val_split", "batches", "Digits", "digits"]
