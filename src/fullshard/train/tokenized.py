"""Text corpora tokenized with a Hugging Face tokenizer (``--tokenizer``, ``--hf-model``).

``--data`` is read as documents, each tokenized and followed by the tokenizer's EOS token, then
concatenated into one stream that :mod:`fullshard.train.data` packs into training windows:

- ``.txt`` (or any other text file): one document; a folder: one document per text file;
- ``.jsonl``: one record per line, either ``{"text": ...}`` or chat-style
  ``{"messages": [{"role": "user", "content": ...}, ...]}``;
- ``.parquet`` (pyarrow): a ``text`` or a ``messages`` column, one record per row.

A chat record is rendered with the tokenizer's chat template and only the assistant turns are
learned: [Note: assistant-only loss] each assistant message's span is found by rendering the
conversation up to just before it (with the generation prompt) and up to just after it; the
characters in between -- the reply and its end-of-turn marker -- are the trainable targets,
mapped to tokens by the fast tokenizer's offsets. Every other target is masked (label -100),
so the template needs no ``{% generation %}`` markers, only to render a conversation's prefix
as a prefix of the whole.

The token stream and its target mask are computed once and cached as ``.npy`` files in
``RUN_DIR/data_cache/``, keyed by the data files (path, size, mtime) and the tokenizer files,
so reruns, resumes and every rank read them memory-mapped instead of re-tokenizing. The
pre-launch checks tokenize without writing (``write=False``); the run writes the entry once
they pass (:class:`PendingCache`).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fullshard.train.data import DataError

__all__ = ["PendingCache", "cached_stream", "encode_record", "load_tokenizer", "read_records"]

_CACHE_VERSION = 1
Record = dict[str, Any]  # {"text": str} or {"messages": [{"role", "content"}, ...]}


def load_tokenizer(path: str) -> Any:
    """A local tokenizer directory as a ``transformers`` tokenizer (never downloaded)."""
    try:
        import transformers
    except ImportError:
        raise DataError(
            "--tokenizer needs the transformers package: pip install 'fullshard[hf]'"
        ) from None
    root = Path(path).expanduser()
    if not root.is_dir():
        raise DataError(
            f"--tokenizer {path!r}: not a directory; give a folder written by "
            "tokenizer.save_pretrained(DIR) (tokenizer.json, tokenizer_config.json)"
        )
    try:
        return transformers.AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"--tokenizer {path}: cannot load a tokenizer there: {e}") from None


def _data_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    return [path]


def read_records(path: Path) -> Iterator[Record]:
    """The documents of one ``--data`` file (see the module docstring for the formats)."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield _check_record(json.loads(line), f"{path}:{lineno}")
                    except json.JSONDecodeError as e:
                        raise DataError(f"--data {path}:{lineno}: not JSON: {e}") from None
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(
                "--data *.parquet needs pyarrow: pip install 'fullshard[data]'"
            ) from None
        table = pq.read_table(path)
        column = next((c for c in ("messages", "text") if c in table.column_names), None)
        if column is None:
            raise DataError(
                f"--data {path}: no 'text' or 'messages' column (has {table.column_names})"
            )
        for i, value in enumerate(table.column(column).to_pylist()):
            yield _check_record({column: value}, f"{path} row {i}")
    else:
        raw = path.read_bytes()
        if b"\0" not in raw[:8192]:  # binary files (in a folder) are skipped, as for bytes
            yield {"text": raw.decode("utf-8", errors="replace")}


def _check_record(rec: Any, where: str) -> Record:
    if isinstance(rec, dict) and isinstance(rec.get("text"), str):
        return {"text": rec["text"]}
    if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
        msgs = rec["messages"]
        if all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            return {"messages": msgs}
    raise DataError(
        f'--data {where}: expected {{"text": "..."}} or {{"messages": [{{"role": '
        f'"user", "content": "..."}}, ...]}}, got {str(rec)[:80]!r}'
    )


def encode_record(tokenizer: Any, rec: Record) -> tuple[list[int], list[int]]:
    """(token ids, target mask: 1 where the token is learned) of one record."""
    if "text" in rec:
        ids = list(tokenizer(rec["text"])["input_ids"])
        eos = tokenizer.eos_token_id
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return ids, [1] * len(ids)
    return _encode_chat(tokenizer, rec["messages"])


def _encode_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """See [Note: assistant-only loss]."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "--data has chat 'messages' but the tokenizer has no chat_template; set "
            'tokenizer.chat_template and save it, or use {"text": ...} records'
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("chat 'messages' need a fast tokenizer (tokenizer.json)")

    def render(msgs: list[dict[str, Any]], prompt: bool) -> str:
        return str(
            tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
        )

    text = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = render(messages[:i], True), render(messages[: i + 1], False)
        if not (text.startswith(before) and text.startswith(upto) and upto.startswith(before)):
            raise DataError(
                "the tokenizer's chat template does not render a conversation's prefix as a "
                "prefix of the whole, so assistant turns cannot be located; use text records"
            )
        spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in enc["offset_mapping"]]
    return ids, mask


def _fingerprint(data: str, tokenizer_dir: str) -> str:
    h = hashlib.sha256(f"v{_CACHE_VERSION}\n".encode())
    root = Path(data).expanduser().resolve()
    h.update(str(root).encode())
    for f in _data_files(root):
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    for f in sorted(Path(tokenizer_dir).expanduser().iterdir()):
        if f.is_file() and ("token" in f.name or f.name.endswith(".jinja")):
            h.update(f.name.encode() + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:20]


def _cache_files(cache_dir: Path, key: str) -> tuple[Path, Path]:
    """(tokens, mask) files of one entry; the tokens file's presence marks it complete."""
    return cache_dir / f"{key}.tokens.npy", cache_dir / f"{key}.mask.npy"


def cached_stream(
    data: str, tokenizer_dir: str, cache_dir: Path | None, *, write: bool = True
) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(uint32 tokens, uint8 target mask or None when every target is learned, cache key).

    Tokenizes ``data`` with the tokenizer at ``tokenizer_dir`` unless ``cache_dir`` holds the
    result already; with ``write``, stores it there (atomically) when it can.
    """
    path = Path(data).expanduser()
    if not data or not path.exists():
        raise DataError(
            f"--data {data!r}: with a tokenizer, give a .txt, .jsonl or .parquet file (or a "
            "folder of text files)"
        )
    key = _fingerprint(data, tokenizer_dir)
    if cache_dir is not None:
        tok_file, mask_file = _cache_files(cache_dir, key)
        if tok_file.exists():
            mask = np.load(mask_file, mmap_mode="r") if mask_file.exists() else None
            return np.load(tok_file, mmap_mode="r"), mask, key
    tokenizer = load_tokenizer(tokenizer_dir)
    ids: list[int] = []
    mask_list: list[int] = []
    for f in _data_files(path):
        for rec in read_records(f):
            i, m = encode_record(tokenizer, rec)
            ids += i
            mask_list += m
    tokens = np.asarray(ids, dtype=np.uint32)
    mask_arr = np.asarray(mask_list, dtype=np.uint8)
    mask = None if mask_arr.all() else mask_arr
    if write and cache_dir is not None:
        PendingCache(cache_dir, key, tokens, mask).write()
    return tokens, mask, key


@dataclass(frozen=True)
class PendingCache:
    """A token stream tokenized but not yet cached: the pre-launch checks tokenize ``--data``
    and write nothing; the run writes the entry (:meth:`write`) once every check has passed."""

    cache_dir: Path
    key: str
    tokens: np.ndarray = field(repr=False)  # 1D uint32
    mask: np.ndarray | None = field(repr=False)  # 1D uint8, None when every target is learned

    def write(self) -> None:
        """Store the entry (atomically) unless the cache holds it already. A directory that
        cannot be written only costs re-tokenizing next time."""
        tok_file, mask_file = _cache_files(self.cache_dir, self.key)
        if tok_file.exists():
            return
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            if self.mask is not None:
                _save_atomic(mask_file, self.mask)
            _save_atomic(tok_file, self.tokens)  # last: its presence means the entry is complete
        except OSError:
            pass


def _save_atomic(path: Path, array: np.ndarray) -> None:
    # unique per writer: every rank of a multi-node job may write the same entry at once
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)
