"""``fullshard ckpt``: inspect a checkpoint, or export it as one full safetensors model.

    fullshard ckpt inspect CKPT [--no-verify]
    fullshard ckpt export CKPT OUT.safetensors [--dtype bf16] [--max-shard-size 5GB]

CKPT is a checkpoint directory, a checkpoints root, or a run directory containing
``checkpoints/`` (meaning its newest complete checkpoint).

Export streams: it writes the safetensors header first (every shape is known from the manifest),
then assembles, converts and writes one tensor at a time, so its peak memory is about the
largest tensor, not the model. When the model is larger than ``--max-shard-size`` it writes a
Hugging Face style set (``model-00001-of-00003.safetensors`` ... plus
``model.safetensors.index.json``). Tied weights are written under every name so that
``model.load_state_dict`` accepts the file as is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
from pathlib import Path

import torch

from .manifest import CheckpointError, TensorRecord
from .reader import CheckpointReader
from .safetensors_io import SafetensorsError, tensor_bytes, write_header

__all__ = ["export", "inspect", "main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"100MiB"`` -> 104_857_600, ``"123"`` -> 123 bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; use e.g. 5GB, 500MB, 100MiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def inspect(path: str | os.PathLike[str], *, verify: bool = True) -> int:
    """Print what a checkpoint holds; with ``verify`` check every checksum. Returns 0 if intact."""
    reader = CheckpointReader(path)
    m = reader.manifest
    print(f"checkpoint: {reader.path}")
    print(f"world size: {m.world_size}")
    print(f"step: {m.extra.get('step', 'unknown')}")
    file_bytes = sum(f["bytes"] for f in m.files.values())
    print(f"files: {len(m.files)}, {file_bytes} bytes ({_human(file_bytes)})")
    status = reader.verify() if verify else {}
    for name, info in sorted(m.files.items()):
        state = status.get(name, "not verified")
        print(f"  {name}  {info['bytes']} bytes  checksum {'ok' if state == 'ok' else state}")
    model_bytes = sum(r.nbytes for r in m.model.values())
    print(f"model tensors: {len(m.model)}, {model_bytes} bytes ({_human(model_bytes)})")
    width = max((len(k) for k in [*m.model, *m.model_aliases]), default=0)
    for fqn, rec in m.model.items():
        print(
            f"  {fqn:<{width}}  {_dtype_name(rec)}  {list(rec.shape)}  {rec.nbytes} bytes"
            f"  {len(rec.shards)} shard(s)"
        )
    for fqn, src in m.model_aliases.items():
        print(f"  {fqn:<{width}}  tied to {src}")
    optim_bytes = 0
    if m.optimizer is not None:
        tensors = [r for _, r in m.all_tensors()[len(m.model) :]]
        nbytes = optim_bytes = sum(r.nbytes for r in tensors)
        names = sorted({n for e in m.optimizer.state.values() for n in e})
        print(
            f"optimizer: {len(m.optimizer.param_groups)} param group(s), state for "
            f"{len(m.optimizer.state)} parameters ({', '.join(names)}), {len(tensors)} tensors, "
            f"{nbytes} bytes ({_human(nbytes)})"
        )
    else:
        print("optimizer: none")
    total = model_bytes + optim_bytes
    print(f"total tensor bytes: {total} ({_human(total)})")
    print(f"extra keys: {sorted(m.extra)}")
    failed = [n for n, s in status.items() if s != "ok"]
    if not verify:
        print("checksums: not verified (--no-verify)")
    elif failed:
        print(f"checksums: FAILED for {len(failed)} of {len(status)} files: {failed}")
    else:
        print(f"checksums: ok ({len(status)} files verified)")
    return 1 if failed else 0


def _dtype_name(rec: TensorRecord) -> str:
    return str(rec.dtype).removeprefix("torch.")


def export(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int = 5 * 10**9,
) -> list[Path]:
    """Write the checkpoint's full model weights to safetensors; return the files written.

    Floating-point tensors are cast to ``dtype`` when given. Streams one tensor at a time.
    """
    reader = CheckpointReader(path)
    m = reader.manifest
    out = Path(out)
    # (name in the file, record, stored name); tied names are written as copies
    items = [(k, rec, k) for k, rec in m.model.items()]
    items += [(alias, m.model[src], src) for alias, src in m.model_aliases.items()]

    def out_dtype(rec: TensorRecord) -> torch.dtype:
        return dtype if dtype is not None and rec.dtype.is_floating_point else rec.dtype

    def out_bytes(rec: TensorRecord) -> int:
        return rec.nbytes // rec.dtype.itemsize * out_dtype(rec).itemsize

    groups: list[list[tuple[str, TensorRecord, str]]] = [[]]
    size = 0
    for item in items:
        n = out_bytes(item[1])
        if groups[-1] and size + n > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    if len(groups) == 1:
        names = [out]
    else:
        stem = out.name.removesuffix(".safetensors")
        names = [
            out.with_name(f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors")
            for i in range(len(groups))
        ]
    for name in m.files:  # sizes, header checksums, dtypes, shapes: fail before writing
        reader.check_file(name)
    # Two buffers reused for every tensor (read, and cast when --dtype changes it): allocating
    # and freeing one per tensor lets malloc keep freed blocks and RSS creep past one tensor.
    read_buf = torch.empty(max((r.nbytes for _, r, _ in items), default=0), dtype=torch.uint8)
    cast_buf = torch.empty(
        max((out_bytes(r) for _, r, _ in items if out_dtype(r) != r.dtype), default=0),
        dtype=torch.uint8,
    )
    made_dir = not out.parent.exists()
    out.parent.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        for target, group in zip(names, groups):
            tmp = target.with_name(target.name + ".tmp")
            written.append(tmp)
            with open(tmp, "wb") as f:
                entries = [(k, out_dtype(r), r.shape) for k, r, _ in group]
                write_header(f, entries, {"format": "pt"})
                for _, rec, src in group:
                    buf = _view(read_buf, rec.dtype, rec.shape)
                    t = reader.read_full(rec, f"model/{src}", buf)
                    if out_dtype(rec) != rec.dtype:
                        t = _view(cast_buf, out_dtype(rec), rec.shape).copy_(t)
                    f.write(tensor_bytes(t))
            os.replace(tmp, target)
            written[-1] = target
    except BaseException:  # e.g. a corrupted block found mid-stream: leave nothing behind
        for path in written:
            path.unlink(missing_ok=True)
        if made_dir:
            with contextlib.suppress(OSError):
                out.parent.rmdir()
        raise
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(out_bytes(r) for _, r, _ in items)},
            "weight_map": {k: names[i].name for i, g in enumerate(groups) for k, _, _ in g},
        }
        index_path = out.with_name(out.name + ".index.json")
        index_path.write_text(json.dumps(index, indent=2))
        return [*names, index_path]
    return names


def _view(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The first bytes of the uint8 ``buf`` as a contiguous ``dtype`` tensor of ``shape``."""
    n = math.prod(shape) * dtype.itemsize
    return buf[:n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)


def main(argv: list[str]) -> int:
    """Entry point of ``fullshard ckpt``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="fullshard ckpt", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="show what a checkpoint holds and verify it")
    p_inspect.add_argument("ckpt", help="checkpoint dir, checkpoints root, or run dir")
    p_inspect.add_argument("--no-verify", action="store_true", help="skip checksum verification")
    p_export = sub.add_parser("export", help="write the full model as safetensors")
    p_export.add_argument("ckpt", help="checkpoint dir, checkpoints root, or run dir")
    p_export.add_argument("out", help="output file, e.g. model.safetensors")
    p_export.add_argument("--dtype", choices=sorted(_DTYPES), help="cast floating tensors")
    p_export.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=5 * 10**9,
        help="split into a Hugging Face style sharded set above this size (default 5GB)",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            return inspect(args.ckpt, verify=not args.no_verify)
        files = export(
            args.ckpt,
            args.out,
            dtype=_DTYPES[args.dtype] if args.dtype else None,
            max_shard_size=args.max_shard_size,
        )
        for f in files:
            print(f"wrote {f} ({f.stat().st_size} bytes)")
        return 0
    except (CheckpointError, SafetensorsError, OSError) as e:
        print(f"fullshard ckpt {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
