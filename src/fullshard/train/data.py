"""Training data: where tokens come from, and deterministic, resumable, rank-sharded sampling.

Sources (``--data``):

- empty: the embedded corpus, the Python standard library's own ``.py`` files (found through
  ``sysconfig``; no download), bytes as tokens;
- a text file, or a folder of text files (binary files skipped), bytes as tokens;
- a ``.bin`` of pre-tokenized uint16/uint32 tokens (nanoGPT's format), memory-mapped.

The tail ``--eval-fraction`` of the token stream is held out for the eval loss.

[Note: sampling] A step consumes one fixed *global* batch of ``global_batch`` windows of
``seq_len + 1`` tokens. Each epoch cuts the stream into non-overlapping windows at a seeded
random shift and visits them in a seeded random order; the sampler's whole state is
``(epoch, offset)``, saved in the checkpoint, so a run resumes mid-epoch exactly. Rank ``r`` of
``W`` takes rows ``[r * G / W, (r + 1) * G / W)`` of the global batch, so the set of sequences in
a step -- and hence the averaged gradient -- does not depend on the number of ranks.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "DataError",
    "Sampler",
    "TokenData",
    "embedded_corpus_files",
    "load_tokens",
    "rank_slice",
]

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


class DataError(ValueError):
    """The data source is missing, empty or unusable; the message names ``--data``."""


def embedded_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files (tests and site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _text_files(folder: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith("."):
                out.append(Path(dirpath) / name)
    return out


def _read_text_bytes(files: list[Path]) -> np.ndarray:
    chunks = []
    for path in files:
        raw = path.read_bytes()
        if b"\0" in raw[:8192]:  # binary file: not text
            continue
        chunks.append(raw)
    return np.frombuffer(b"\n\n".join(chunks), dtype=np.uint8)


def bin_dtype(data_dtype: str, vocab_size: int) -> np.dtype:
    """dtype of a ``.bin`` file: as given, or uint16 when ``vocab_size`` fits, else uint32."""
    if data_dtype == "auto":
        return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    return np.dtype(data_dtype)


def describe_source(data: str) -> str:
    """A short human description of ``--data``."""
    if not data:
        return f"Python {sysconfig.get_python_version()} standard library source (embedded)"
    return data


def load_tokens(data: str, *, data_dtype: str = "auto", vocab_size: int = 256) -> np.ndarray:
    """All tokens of ``--data`` as a 1-D array (memory-mapped for ``.bin``)."""
    if not data:
        return _read_text_bytes(embedded_corpus_files())
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(
            f"--data: {data!r} does not exist; pass a text file, a folder of text files or a "
            ".bin of tokens (or omit --data for the embedded corpus)"
        )
    if path.is_dir():
        return _read_text_bytes(_text_files(path))
    if path.suffix == ".bin":
        dtype = bin_dtype(data_dtype, vocab_size)
        if path.stat().st_size % dtype.itemsize:
            raise DataError(
                f"--data {data}: size {path.stat().st_size} is not a multiple of {dtype} "
                f"({dtype.itemsize} bytes); check --data-dtype"
            )
        if path.stat().st_size == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r")
    return _read_text_bytes([path])


@dataclass
class TokenData:
    """A token stream split into a training part and a held-out tail."""

    train: np.ndarray  # 1D tokens
    eval: np.ndarray  # 1D tokens, the held-out tail (may be empty)
    byte_level: bool  # tokens are raw bytes (decode a sample as UTF-8)

    @classmethod
    def split(cls, tokens: np.ndarray, eval_fraction: float, *, byte_level: bool) -> TokenData:
        """Hold out the last ``eval_fraction`` of ``tokens``."""
        n_eval = int(len(tokens) * eval_fraction)
        cut = len(tokens) - n_eval
        return cls(train=tokens[:cut], eval=tokens[cut:], byte_level=byte_level)


def check_size(tokens: int, *, seq_len: int, eval_fraction: float, source: str) -> None:
    """Raise :class:`DataError` unless there is at least one window to train and to evaluate."""
    if tokens == 0:
        raise DataError(f"--data: the corpus {source!r} is empty (no text found)")
    n_eval = int(tokens * eval_fraction)
    need = seq_len + 1
    if tokens - n_eval < need or (eval_fraction > 0 and n_eval < need):
        total_need = (
            need if eval_fraction == 0 else int(need / min(eval_fraction, 1 - eval_fraction)) + 1
        )
        raise DataError(
            f"--data: the corpus {source!r} has {tokens} tokens, too few for one "
            f"{need}-token window (--seq-len {seq_len}) in both the training part and the "
            f"held-out {eval_fraction:g} (--eval-fraction); it needs about {total_need} tokens: "
            "use more data, a smaller --seq-len, or --eval-fraction 0"
        )


class Sampler:
    """Deterministic, resumable global batches of window start offsets; see [Note: sampling]."""

    def __init__(self, n_tokens: int, *, seq_len: int, global_batch: int, seed: int) -> None:
        if n_tokens < seq_len + 1:
            raise DataError(f"{n_tokens} tokens cannot hold one {seq_len + 1}-token window")
        self.n_tokens = n_tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.epoch = 0
        self.offset = 0  # windows of this epoch already consumed
        self._order: np.ndarray | None = None  # 1D start offsets of this epoch, in visit order

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            rng = np.random.default_rng([self.seed, self.epoch])
            span = self.n_tokens - 1  # a window needs seq_len inputs + 1 shifted target
            shift = int(rng.integers(0, self.seq_len)) if span >= 2 * self.seq_len else 0
            n_windows = (span - shift) // self.seq_len
            starts = shift + self.seq_len * np.arange(n_windows, dtype=np.int64)
            self._order = starts[rng.permutation(n_windows)]
        return self._order

    def next_batch(self) -> np.ndarray:
        """Start offsets of the next global batch (``global_batch`` of them), advancing state."""
        out: list[np.ndarray] = []
        need = self.global_batch
        while need:
            order = self._epoch_order()
            take = order[self.offset : self.offset + need]
            out.append(take)
            need -= len(take)
            self.offset += len(take)
            if self.offset >= len(order):
                self.epoch, self.offset, self._order = self.epoch + 1, 0, None
        return np.concatenate(out)

    def state_dict(self) -> dict[str, int]:
        """JSON-able state: where in which epoch the next batch starts."""
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict`."""
        self.epoch, self.offset, self._order = int(state["epoch"]), int(state["offset"]), None


def eval_starts(n_tokens: int, *, seq_len: int, count: int) -> np.ndarray:
    """The first ``count`` non-overlapping windows of the held-out tail (cycled if short)."""
    n_windows = (n_tokens - 1) // seq_len
    if n_windows < 1:
        return np.zeros(0, dtype=np.int64)
    return seq_len * (np.arange(count, dtype=np.int64) % n_windows)


def rank_slice(global_batch: int, rank: int, world_size: int) -> slice:
    """Rows of the global batch that ``rank`` trains on."""
    per_rank = global_batch // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def gather_windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    """``[len(starts), seq_len + 1]`` int64 windows of ``tokens`` starting at ``starts``."""
    rows = [np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts.tolist()]
    return torch.from_numpy(np.stack(rows))
