"""``fullshard ckpt``: inspect a checkpoint, or export it as one full safetensors model.

    fullshard ckpt inspect CKPT [--no-verify]
    fullshard ckpt export CKPT OUT.safetensors [--dtype bf16] [--max-shard-size 5GB] [--force]
    fullshard ckpt export CKPT --hf DIR [--dtype bf16] [--force]     # a loadable model directory

CKPT is a checkpoint directory, a checkpoints root, or a run directory containing
``checkpoints/`` (meaning its newest complete checkpoint).

Export streams (see :mod:`fullshard.checkpoint.export`): its peak memory is about the
largest tensor, not the model. When the model is larger than ``--max-shard-size`` it writes a
Hugging Face style set (``model-00001-of-00003.safetensors`` ... plus
``model.safetensors.index.json``). Tied weights are written under every name so that
``model.load_state_dict`` accepts the file as is. ``--hf DIR`` writes a model directory
(config.json, shards + index, tokenizer). An existing output is refused unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .manifest import TensorRecord

# Everything that imports torch is imported once the arguments are parsed, so that --help and
# argument errors take a fraction of a second.
__all__ = ["inspect", "main"]

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> torch's
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
    from .reader import CheckpointReader

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
    p_export.add_argument("out", nargs="?", help="output file, e.g. model.safetensors")
    p_export.add_argument(
        "--hf",
        metavar="DIR",
        help="write a model directory instead: config.json, safetensors shards + index and the "
        "run's tokenizer (Hugging Face from_pretrained; fullshard.train.models.load_exported)",
    )
    p_export.add_argument("--force", action="store_true", help="overwrite an existing output")
    p_export.add_argument(
        "--model-config",
        metavar="CONFIG.json",
        help="with --hf, for checkpoints that do not record their model: its HF config.json",
    )
    p_export.add_argument("--dtype", choices=sorted(_DTYPES), help="cast floating tensors")
    p_export.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=5 * 10**9,
        help="split into a Hugging Face style sharded set above this size (default 5GB)",
    )
    args = parser.parse_args(argv)
    if args.command == "export" and (args.out is None) == (args.hf is None):
        parser.error("export: give an output file OUT.safetensors or --hf DIR (one of them)")
    import torch

    from .export import export, export_hf
    from .manifest import CheckpointError
    from .safetensors_io import SafetensorsError

    try:
        if args.command == "inspect":
            return inspect(args.ckpt, verify=not args.no_verify)
        dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
        if args.hf is not None:
            model = None
            if args.model_config:
                model = {"kind": "hf", "config": json.loads(Path(args.model_config).read_text())}
            files = export_hf(
                args.ckpt,
                args.hf,
                dtype=dtype,
                max_shard_size=args.max_shard_size,
                force=args.force,
                model=model,
            )
        else:
            files = export(
                args.ckpt,
                args.out,
                dtype=dtype,
                max_shard_size=args.max_shard_size,
                overwrite=args.force,
            )
        for f in files:
            print(f"wrote {f} ({f.stat().st_size} bytes)")
        return 0
    except (CheckpointError, SafetensorsError, OSError, ValueError) as e:
        print(f"fullshard ckpt {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
