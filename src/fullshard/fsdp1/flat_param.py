"""What a wrapper's ``_flat_param`` gives in place of FSDP1's ``FlatParameter``.

fullshard has no flat parameter, but frameworks read a few of its attributes: Accelerate, when
mixed precision is on, checks every wrapper's ``_flat_param`` for ``dtype``, ``device`` and
``requires_grad`` and, if the model was loaded in low precision, upcasts it to float32 in place
(``flat_param.data = flat_param.data.to(torch.float32)``). :class:`FlatParamSummary` answers
the reads for the wrapper's own parameters; the in-place upcast is refused with the fix (load
the model in float32), since fullshard's units keep their parameters' dtype.

Frameworks also tell FSDP1's parameters by torch's mark, an attribute ``_fsdp_flattened =
True``: torch's FSDP1 sets it on each ``FlatParameter`` and, with ``use_orig_params=True``, on
the original parameters it keeps, so whatever ``model.parameters()`` yields for a wrapped
module carries it. Lightning's ``FSDPStrategy`` with ``use_orig_params=False`` refuses an
optimizer whose parameters lack it ("The optimizer does not seem to reference any FSDP
parameters"). :func:`mark_flattened` sets it on a wrapper's parameters, whatever
``use_orig_params`` says (there is no other parameter to mark); ignored ones stay unmarked, as
in FSDP1.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["FSDP_FLATTENED", "FlatParamSummary", "mark_flattened"]

# the attribute torch's FSDP1 marks its parameters with (FSDP_FLATTENED in its private common utils)
FSDP_FLATTENED = "_fsdp_flattened"


def mark_flattened(params: Iterable[nn.Parameter]) -> None:
    """Mark ``params`` (a wrapper's own parameters) as managed by FSDP1, as torch's FSDP1
    marks the parameters it manages (its ``_set_fsdp_flattened``)."""
    for p in params:
        setattr(p, FSDP_FLATTENED, True)


class FlatParamSummary:
    """The attributes of FSDP1's ``FlatParameter`` that frameworks read, for ``params`` (the
    wrapper's own parameters, named ``fqns``)."""

    def __init__(self, params: list[nn.Parameter], fqns: list[str]) -> None:
        self._params = params
        self._fqns = tuple(fqns)  # FSDP1's FlatParameter._fqns

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype (FSDP1 wants one per wrapper; the first one's if not)."""
        return self._params[0].dtype

    @property
    def device(self) -> torch.device:
        return self._params[0].device

    @property
    def requires_grad(self) -> bool:
        return any(p.requires_grad for p in self._params)

    @property
    def data(self) -> torch.Tensor:
        raise NotImplementedError(
            f"fullshard's FullyShardedDataParallel has no flat parameter to cast in place: its "
            f"parameters ({', '.join(self._fqns)}) keep their dtype ({self.dtype}). Load the "
            f"model in float32; MixedPrecision(param_dtype=...) computes in the low precision"
        )
