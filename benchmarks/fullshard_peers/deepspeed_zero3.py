"""DeepSpeed ZeRO stage 3, the peer engine ``fullshard bench``'s ``deepspeed`` mode trains.

Benchmark code, not library code: it runs only inside a bench rank, loaded by name through
``fullshard.peers`` (``load_peer("deepspeed")``), and imports DeepSpeed only when a rank builds
the engine, so that ``missing()`` answers without importing it. DeepSpeed comes from the
optional ``peers`` extra (``pip install 'fullshard[peers]'``).

What the bench gives DeepSpeed is what it gives every mode: the same model (built from the same
seed, then handed to ``deepspeed.initialize``, which partitions it), the same batches, the same
``torch.optim.AdamW`` (which DeepSpeed wraps in its ZeRO-3 optimizer) and fp32 (no ``fp16`` /
``bf16`` section) and no gradient clipping (DeepSpeed's default clips to norm 1.0; no mode
clips). The config names ZeRO stage 3 and nothing else about it: every ZeRO knob is DeepSpeed's
default (``describe()`` reports them as DeepSpeed resolved them). DeepSpeed runs on
the rank's existing gloo process group with its CPU accelerator (``DS_ACCELERATOR=cpu``), whose
start-up JIT-builds one small C++ op the first time (cached in ``~/.cache/torch_extensions``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings
from typing import Any

__all__ = ["INSTALL", "ZeRO3", "config", "load", "missing"]

#: How to get DeepSpeed, in one line (pyproject's ``peers`` extra pins the tested range).
INSTALL = "pip install 'fullshard[peers]'  (from a checkout: pip install -e '.[peers]')"

#: ZeRO knobs ``describe()`` prints, as DeepSpeed resolved its defaults (the rest are in the JSON).
SHOWN_KNOBS = (
    "overlap_comm",
    "contiguous_gradients",
    "reduce_bucket_size",
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
)


def missing() -> str | None:
    """``None`` if DeepSpeed is importable here, else why not and the one-line install."""
    if importlib.util.find_spec("deepspeed") is None:
        return f"DeepSpeed is not installed; install it with: {INSTALL}"
    return None


def config(micro_batch: int) -> dict[str, Any]:
    """The config DeepSpeed gets: ZeRO stage 3 with its defaults, fp32, one micro-batch a step.

    ``gradient_clipping`` is 0 (none) because no mode clips: DeepSpeed's own default, 1.0,
    would clip every step's gradient to norm 1 and train another model (on the bench's GPT the
    losses leave the others' at the third step). No ``fp16`` / ``bf16`` section: fp32, as every
    mode.
    """
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3},
    }


def load() -> Any:
    """``import deepspeed`` on the CPU accelerator, its prints and logs on stderr, not stdout
    (``fullshard bench --json`` owns stdout)."""
    os.environ["DS_ACCELERATOR"] = "cpu"  # bench ranks are gloo ranks on the CPU
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed  # its logger's handler binds the stream current at import: stderr

    return deepspeed


class ZeRO3:
    """DeepSpeed's ZeRO-3 engine behind the bench loop's three calls: forward, backward, step.

    ``model`` is the bench's model as built (plain parameters); ``optimizer`` its AdamW over
    ``model.parameters()``. DeepSpeed needs its own ``backward`` (it reduce-scatters from its
    hooks and scales by the accumulation steps) and its ``step`` zeroes the gradients.
    """

    def __init__(self, model: Any, optimizer: Any, micro_batch: int) -> None:
        self.config = config(micro_batch)
        ds = load()
        # torch 2.13 deprecates the collectives' names DeepSpeed calls (same functions).
        warnings.filterwarnings(
            "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
        )
        with contextlib.redirect_stdout(sys.stderr):  # "op built successfully" is a print
            self.engine, *_ = ds.initialize(model=model, optimizer=optimizer, config=self.config)
        self.version: str = ds.__version__
        self._cdb = ds.comm.comm.cdb  # the process-wide communication backend

    def __call__(self, x: Any) -> Any:
        return self.engine(x)

    def backward(self, loss: Any) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        """The optimizer step, then the gradients zeroed (DeepSpeed does both in ``step``)."""
        self.engine.step()

    def cached_collectives(self) -> list[tuple[Any, str, str]]:
        """``(owner, attribute, torch function)`` for each collective DeepSpeed bound at start-up.

        Its torch backend looks ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` up once
        and calls them through these attributes, so a meter that wraps ``torch.distributed``'s
        functions must wrap these too (``all_reduce`` is looked up at call time).
        """
        return [
            (self._cdb, "all_gather_function", "all_gather_into_tensor"),
            (self._cdb, "reduce_scatter_function", "reduce_scatter_tensor"),
        ]

    def describe(self) -> dict[str, Any]:
        """The version, the config passed and ZeRO's settings as DeepSpeed resolved them."""
        zero = self.engine._config.zero_config.model_dump()  # pydantic: every resolved knob
        zero.pop("leaf_module", None)  # transformers' MoE class names: noise here
        return {
            "engine": f"DeepSpeed {self.version}",
            "config": self.config,
            "zero_resolved": zero,
            "shown": {k: zero.get(k) for k in SHOWN_KNOBS},
        }
