"""``fullshard bench``: side-by-side speed, memory and traffic against torch FSDP2, DeepSpeed and DDP.

- :mod:`~fullshard.bench.configs` — the shipped configurations and modes.
- :mod:`~fullshard.bench.worker` — one run on one rank (build, wrap, train, meter).
- :mod:`~fullshard.bench.comm` — collective calls/bytes/blocked time per step.
- :mod:`~fullshard.bench.runner` — alternate modes over repeats and aggregate.
- :mod:`~fullshard.bench.report` — tables, Markdown and target verdicts.
- :mod:`~fullshard.bench.overhead` — ``--config overhead``: the engine's cost per unit per step.
- :mod:`~fullshard.bench.trace` — stream overlap read off a ``torch.profiler`` trace (GPU check).
- :mod:`~fullshard.bench.cli` — the command.
"""
