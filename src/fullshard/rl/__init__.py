"""fullshard.rl: what RL post-training needs between training steps.

- :func:`sleep` / :func:`wake` / :func:`asleep` (``fullshard.rl.sleep``): parameters, gradients,
  optimizer state and buffers to host memory and back, bit for bit, in the same tensors;
- :func:`gathered_for_rollout` (``fullshard.rl.rollout``): a ``generate()`` loop gathers each
  unit once for the whole rollout.

``import fullshard.rl`` (the package's top level does not import it).
"""

from __future__ import annotations

from .rollout import gathered_for_rollout
from .sleep import SleepReport, asleep, is_asleep, sleep, wake

__all__ = ["SleepReport", "asleep", "gathered_for_rollout", "is_asleep", "sleep", "wake"]
