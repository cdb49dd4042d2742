"""Optimizers for fully sharded models that need whole tensors (Muon, Shampoo, ...).

- :class:`WholeTensor`: run any per-tensor ``torch.optim.Optimizer`` on whole tensors of a
  sharded model, exactly (each tensor stepped by one owner rank).
- :class:`MultiOptimizer`: several optimizers over disjoint parameters as one (Muon on the
  matrices, AdamW on the rest).
- :class:`Muon`: ``torch.optim.Muon`` with a choice of Newton-Schulz dtype (float32 is the
  fast one on CPUs without native bf16 matmuls).
- :func:`local_step`: step an element-wise optimizer (AdamW, SGD, ...) on the local shards,
  bit-for-bit the DTensor step without DTensor's per-op dispatch.
- :class:`Shampoo`: a small whole-matrix preconditioner optimizer (a reference and test case).

See ``docs/optim.md``.
"""

from .exchange import Traffic
from .local import ELEMENTWISE, local_step
from .multi import MultiOptimizer
from .muon import Muon
from .shampoo import Shampoo
from .whole import WholeTensor

__all__ = [
    "ELEMENTWISE",
    "MultiOptimizer",
    "Muon",
    "Shampoo",
    "Traffic",
    "WholeTensor",
    "local_step",
]
