"""Training data: where tokens come from, and deterministic, resumable, rank-sharded sampling.

Sources (``--data``):

- empty: the embedded corpus, the Python standard library's own ``.py`` files (found through
  ``sysconfig``; no download), bytes as tokens;
- a text file, or a folder of text files (binary files skipped), bytes as tokens;
- a ``.bin`` of pre-tokenized uint16/uint32 tokens (nanoGPT's format), memory-mapped;
- with ``--tokenizer`` (or ``--hf-model``): ``.txt``, ``.jsonl`` (text or chat messages) and
  ``.parquet`` records tokenized once and cached (:mod:`fullshard.train.tokenized`), with a
  target mask where only assistant turns are learned.

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
    "IGNORE_INDEX",
    "DataError",
    "Sampler",
    "TokenData",
    "embedded_corpus_files",
    "gather_batch",
    "load_data",
    "load_tokens",
    "rank_slice",
]

IGNORE_INDEX = -100  # the label of a target that is not learned (cross_entropy's default)

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


def load_data(
    data: str,
    *,
    data_dtype: str = "auto",
    vocab_size: int = 256,
    tokenizer: str = "",
    cache_dir: Path | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """(1-D tokens, 1-D uint8 target mask or ``None`` when every target is learned).

    With ``tokenizer`` (a local tokenizer directory) the text of ``data`` is tokenized, or read
    from ``cache_dir`` (and cached there); otherwise :func:`load_tokens`.
    """
    if tokenizes(data, tokenizer):
        from fullshard.train.tokenized import cached_stream

        tokens, mask, _ = cached_stream(data, tokenizer, cache_dir)
        return tokens, mask
    return load_tokens(data, data_dtype=data_dtype, vocab_size=vocab_size), None


def tokenizes(data: str, tokenizer: str) -> bool:
    """Whether ``--data`` is tokenized with ``tokenizer`` (a ``.bin`` is tokenized already)."""
    return bool(tokenizer) and Path(data).suffix != ".bin"


@dataclass
class TokenData:
    """A token stream split into a training part and a held-out tail."""

    train: np.ndarray  # 1D tokens
    eval: np.ndarray  # 1D tokens, the held-out tail (may be empty)
    byte_level: bool  # tokens are raw bytes (decode a sample as UTF-8)
    train_mask: np.ndarray | None = None  # 1D uint8 like train: 1 where a target is learned
    eval_mask: np.ndarray | None = None

    @classmethod
    def split(
        cls,
        tokens: np.ndarray,
        eval_fraction: float,
        *,
        byte_level: bool,
        mask: np.ndarray | None = None,
    ) -> TokenData:
        """Hold out the last ``eval_fraction`` of ``tokens`` (and of ``mask``)."""
        n_eval = int(len(tokens) * eval_fraction)
        cut = len(tokens) - n_eval
        return cls(
            train=tokens[:cut],
            eval=tokens[cut:],
            byte_level=byte_level,
            train_mask=None if mask is None else mask[:cut],
            eval_mask=None if mask is None else mask[cut:],
        )


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


def gather_batch(
    tokens: np.ndarray, mask: np.ndarray | None, starts: np.ndarray, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``, each ``[len(starts), seq_len]`` int64: the windows at ``starts``
    and the same shifted by one, with :data:`IGNORE_INDEX` at targets the mask excludes."""
    windows = gather_windows(tokens, starts, seq_len)
    inputs, targets = windows[:, :-1], windows[:, 1:].clone()
    if mask is not None:
        learned = gather_windows(mask, starts, seq_len)[:, 1:].bool()
        targets[~learned] = IGNORE_INDEX
    return inputs, targets


def count_targets(mask: np.ndarray | None, starts: np.ndarray, seq_len: int) -> int:
    """Learned targets in the windows at ``starts`` (every one of them without a mask)."""
    if mask is None:
        return len(starts) * seq_len
    return int(sum(int(np.count_nonzero(mask[s + 1 : s + seq_len + 1])) for s in starts.tolist()))
