"""``FullyShardError``: the exception for misuse FSDP2 reports with ``AssertionError``.

It lives in the engine so that every layer can raise it (the engine validates placements and
parameters); ``fullshard.FullyShardError`` is the public name.
"""

from __future__ import annotations

__all__ = ["FullyShardError"]


class FullyShardError(ValueError, AssertionError):
    """A misuse FSDP2 reports with ``AssertionError`` (fullshard also makes it a ``ValueError``).

    Raised for ``fully_shard`` applied twice to one module, an unnamed 2-D mesh, a
    ``shard_placement_fn`` dim the parameter does not have, ``copy.deepcopy`` of a unit and a
    method called on a module that is no unit: code written against either library catches
    it. Its message starts with FSDP2's where FSDP2 raises one.
    """
