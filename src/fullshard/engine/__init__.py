"""The sharding engine: what moves parameters and gradients between ranks during a step.

Nothing here is public API: ``fullshard.fully_shard`` / ``fullshard.FSDPModule`` (above, in
``fullshard.api`` and ``fullshard.module``) are. Tools (``train``, ``bench``, ``memory``,
``checkpoint``, ``optim``) import engine modules by name where they need the layout of a
unit. docs/design.md draws the layers and which module does what.
"""
