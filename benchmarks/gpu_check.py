"""The GPU check: fullshard against torch FSDP2 on one CUDA GPU (NCCL at world size 1).

    bash scripts/gpu_check.sh [--out DIR] [--trace-dir DIR] [--budget-s 440] [--only KEYS]
    bash scripts/gpu_check.sh --dry-run --out DIR     # the same flow on the CPU, tiny sizes

Checks, in order (``--only`` takes their keys):

- ``parity``: a small GPT trained 5 AdamW steps under each engine against the unsharded model,
  fp32 and bf16 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, fullshard
  against FSDP2 under the same policy);
- ``buffers``: the same with the comm-buffer knobs on every unit (process-group allocator,
  symmetric memory);
- ``offload``: CPU offload parity (``CPUOffloadPolicy(pin_memory=True)``: shards must live in
  pinned host memory) and how much host<->device copy time ran under compute, from a trace;
- ``overhead``: ``fullshard bench --config overhead`` on the GPU: per-unit CPU cost of 64 tiny
  units against FSDP2's;
- ``llama``: a Llama-3.2-1B-shaped model, every decoder layer a unit, bf16 compute: peak
  ``max_memory_allocated`` and median step time against FSDP2 (alternating), and the
  prefetch overlap read off a profiler trace of one step per engine;
- ``rl``: ``fullshard.rl`` on an 8-layer Llama (0.75B), every decoder layer a unit: all
  weights in bf16 by ``publish`` against per-weight ``full_tensor()`` (seconds, GB/s, gathers,
  bit for bit), one ``ShardDeltas`` delta, ``sleep`` / ``wake`` after an AdamW step (seconds,
  ``memory_allocated`` before / asleep / woken, pinned host copy, state bit for bit, the next
  step's loss against a model that never slept) and ``gathered_for_rollout``'s gathers;
- ``colocated``: the same Llama's weights handed by ``publish_colocated`` to an engine process
  on the same GPU as bf16 buckets through CUDA IPC handles (ms against ``publish`` into a
  receiver in-process; the engine's weights bit for bit, every view inside its bucket);
- ``graph``: a 4-layer Llama's whole step (forward, loss, backward, ``finalize_backward``)
  under ``set_keep_unsharded_storage`` and manual finalization captured with
  ``torch.cuda.graphs.CUDAGraph`` after warm-up, replayed step after step and checked bit for
  bit against the same steps eager (step times of both), after a steady-state step in which
  the engine must create no tensor and make no host wait;
- ``train``: ``fullshard train --preset llama-1b`` for 30 steps: tokens/s, MFU, step time and
  peak memory beside ``fullshard plan``'s prediction of the same run on an H200.

The JSON report and a markdown table are rewritten in ``--out`` after each check, so a run
stopped at its time limit keeps what it finished; a check that no longer fits in ``--budget-s``
is reported SKIPPED ('time budget'). Exit 1 when a parity check fails, a check raises or one was
skipped; speed and memory against FSDP2 and the plan are reported, never failed on.

Without a CUDA GPU it prints one line saying it skipped and exits 0 (but exits 1 where the
driver sees GPUs and torch is a CPU build). ``--dry-run`` runs every check on the CPU (gloo)
at tiny sizes, through the same code except what needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the gpu_check_* modules
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # this checkout's

import torch
import torch.distributed as dist
from gpu_check_colocated import check_colocated
from gpu_check_common import Ctx
from gpu_check_engines import check_comm_buffers, check_offload, check_parity
from gpu_check_graph import check_graph
from gpu_check_llama import check_llama
from gpu_check_report import Check, Report, run_checks, table
from gpu_check_rl import check_rl
from gpu_check_runs import check_overhead, check_train

#: key, title, check, seconds it needs on one H200 (what the time budget goes by)
CHECKS = (
    ("parity", "parity fp32/bf16", check_parity, 30.0),
    ("buffers", "comm buffers", check_comm_buffers, 30.0),
    ("offload", "CPU offload", check_offload, 40.0),
    ("overhead", "per-unit overhead", check_overhead, 30.0),
    ("llama", "Llama 1B", check_llama, 100.0),
    ("rl", "RL weight sync + sleep/wake", check_rl, 40.0),
    ("colocated", "RL colocated buckets", check_colocated, 20.0),
    ("graph", "CUDA graph of a whole step", check_graph, 25.0),
    ("train", "train --preset llama-1b", check_train, 120.0),
)
#: sizes: (on the GPU, under --dry-run); a flag given on the command line wins
SIZES = {
    "llama_layers": (16, 2),
    "batch": (4, 2),
    "seq": (1024, 32),
    "steps": (12, 4),
    "warmup": (3, 1),
    "repeats": (2, 2),
    "train_steps": (30, 3),
    "train_global_batch": (16, 4),
    "train_warmup": (5, 1),
    "overhead_units": (64, 8),
    "rl_layers": (8, 2),
    "rl_repeats": (5, 2),
    "graph_layers": (4, 2),
    "graph_steps": (10, 3),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", help="folder for gpu_check.json, gpu_check.md and the run's logs")
    p.add_argument("--trace-dir", help="keep the profiler traces here (default: a temp folder)")
    p.add_argument("--dry-run", action="store_true", help="every check on the CPU, tiny sizes")
    p.add_argument("--budget-s", type=float, default=440.0, help="time budget of all checks")
    p.add_argument(
        "--only", type=lambda s: s.split(","), help=f"keys: {','.join(c[0] for c in CHECKS)}"
    )
    p.add_argument("--plan-gpu", default="h200", help="the planner's GPU (fullshard plan --gpu)")
    p.add_argument("--llama-layers", type=int, help="decoder layers (16 = 1.2B)")
    p.add_argument("--batch", type=int, help="Llama sequences per step")
    p.add_argument("--seq", type=int, help="Llama sequence length")
    p.add_argument("--steps", type=int, help="Llama steps per run (warmup included)")
    p.add_argument("--warmup", type=int, help="Llama steps not timed")
    p.add_argument("--repeats", type=int, help="Llama runs per engine, alternating")
    p.add_argument("--train-steps", type=int, help="fullshard train steps")
    p.add_argument("--train-global-batch", type=int, help="fullshard train --global-batch")
    p.add_argument("--train-warmup", type=int, help="training steps left out of the medians")
    p.add_argument("--overhead-units", type=int, help="units of the overhead model")
    p.add_argument("--rl-layers", type=int, help="decoder layers of the RL Llama (8 = 0.75B)")
    p.add_argument("--rl-repeats", type=int, help="timed weight syncs per method")
    p.add_argument("--graph-layers", type=int, help="decoder layers of the captured Llama")
    p.add_argument("--graph-steps", type=int, help="graph replays checked against eager")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    for name, sizes in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, sizes[args.dry_run])
    unknown = set(args.only or []) - {c[0] for c in CHECKS}
    if unknown:
        p.error(f"--only: unknown checks {sorted(unknown)}")
    return args


def _gpus_the_driver_sees() -> int:
    """How many GPUs ``nvidia-smi -L`` lists (0 without the tool or a driver)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def _no_gpu() -> int:
    """Exit code without CUDA: 0 (skipped), or 1 where the driver sees GPUs but torch is a CPU
    build (e.g. a CPU venv carried over): the check would otherwise report green unrun."""
    gpus = _gpus_the_driver_sees()
    if gpus and torch.version.cuda is None and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        print(
            f"gpu_check: failed: the driver sees {gpus} GPU(s) but torch {torch.__version__} "
            "is a CPU build; install a CUDA build of torch (pip install torch from PyPI) "
            "and rerun",
            file=sys.stderr,
        )
        return 1
    print(f"gpu_check: skipped: no CUDA GPU visible to torch {torch.__version__}")
    return 0


def _init(device: str) -> tuple[object, str]:
    """The one-rank process group (NCCL on CUDA, gloo on the CPU): its mesh and a header."""
    from torch.distributed.device_mesh import init_device_mesh

    from fullshard.testing import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    if device == "cpu":
        dist.init_process_group("gloo", init_method=url, rank=0, world_size=1)
        header = f"gpu_check --dry-run: CPU (gloo), torch {torch.__version__}, world size 1"
        return init_device_mesh("cpu", (1,)), header + ", tiny sizes"
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=url, rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    nccl = torch.cuda.nccl.version()
    nccl_s = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    header = f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
    return init_device_mesh("cuda", (1,)), header + f"NCCL {nccl_s}, world size 1"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path even on a GPU machine
    elif not torch.cuda.is_available():
        return _no_gpu()
    device = "cpu" if args.dry_run else "cuda"
    mesh, header = _init(device)
    print(header, flush=True)
    out_dir = Path(args.out) if args.out else None
    with tempfile.TemporaryDirectory() as tmp:
        work = out_dir or Path(tmp)
        trace_dir = Path(args.trace_dir or tmp)
        for d in (work, trace_dir):
            d.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + args.budget_s
        ctx = Ctx(device, args.dry_run, mesh, trace_dir, work, args, deadline)
        report = Report(header, out_dir, args.budget_s, details=ctx.details)
        checks = [
            Check(key, title, partial(fn, ctx), estimate)
            for key, title, fn, estimate in CHECKS
            if not args.only or key in args.only
        ]
        run_checks(checks, report)
    dist.destroy_process_group()
    print(table(report.rows, header))
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
