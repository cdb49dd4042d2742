"""One rank of ``fullshard train``, the module torchrun runs.

``fullshard train`` launches it locally; for several machines run it under torchrun yourself,
e.g. on each of two nodes::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint node0:29500 --rdzv-id myrun \\
        -m fullshard.train.worker --preset gpt2-124m --run-dir /shared/runs/gpt2

It takes the same flags as ``fullshard train`` (``--nproc`` is ignored: torchrun decides).
A restart that torchrun's agent makes after a deterministic failure ends at once, before
torch is imported ([Note: no restart under a bare torchrun] in failures.py).
"""

from __future__ import annotations

import os
import sys

from fullshard.train import failures
from fullshard.train.cli import main as cli_main

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run as one rank (the torchrun environment is required)."""
    args = sys.argv[1:] if argv is None else argv
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(
            "fullshard.train.worker is one rank of a torchrun job (RANK/WORLD_SIZE unset); "
            "run `fullshard train` to launch local ranks, or start it with torchrun",
            file=sys.stderr,
        )
        return 2
    refused = failures.exit_if_restart_refused()
    if refused is not None:
        return refused
    from torch.distributed.elastic.multiprocessing.errors import record

    # record: the agent then reports this rank's traceback as the root cause of a failure
    return record(cli_main)(args) or 0


if __name__ == "__main__":
    sys.exit(main())
