"""What the installed torch's FSDP2 has, for tests of features newer than the oldest supported
torch: ``fullshard.engine.compat`` refuses those where torch lacks them, so their tests run
where torch has them and check the refusal (``test_torch_range.py``) where it does not."""

from __future__ import annotations

import pytest
import torch

from fullshard.engine.compat import FSDP_MODULE_METHODS_SINCE, TorchFeature

__all__ = ["has_method", "needs", "needs_method"]


def has_method(name: str) -> bool:
    """Whether the installed torch's ``FSDPModule`` has the method ``name``."""
    return TorchFeature(name, FSDP_MODULE_METHODS_SINCE.get(name, (0, 0))).available


def _reason(what: str, since: tuple[int, int]) -> str:
    return f"{what} needs torch {since[0]}.{since[1]}+ (installed: {torch.__version__})"


def needs(feature: TorchFeature) -> pytest.MarkDecorator:
    """Skip the test where the installed torch lacks ``feature``."""
    return pytest.mark.skipif(not feature.available, reason=_reason(feature.what, feature.since))


def needs_method(*names: str) -> pytest.MarkDecorator:
    """Skip the test where the installed torch's ``FSDPModule`` lacks one of ``names``."""
    missing = [n for n in names if not has_method(n)]
    since = max((FSDP_MODULE_METHODS_SINCE[n] for n in missing), default=(0, 0))
    return pytest.mark.skipif(bool(missing), reason=_reason(f"FSDPModule.{missing}", since))
