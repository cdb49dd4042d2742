"""What rank 0 reports: ``metrics.jsonl``, the live progress bar or log lines, and ``loss.png``.

``metrics.jsonl`` holds one JSON object per line, each with a ``kind``:

- ``start``: ``step`` (the step training resumes after, 0 when fresh), ``world_size``,
  ``resumed_from`` (checkpoint path or null), ``parameters``, ``time``;
- ``train``: ``step``, ``loss``, ``lr``, ``grad_norm``, ``skipped`` (non-finite gradients),
  ``tokens`` (seen so far), ``tokens_per_s``, ``step_time_s``, ``peak_mem_mib`` (one per
  rank), ``time``;
- ``eval``: ``step``, ``loss`` (mean over the held-out batches), ``time``;
- ``stop``: ``step``, ``reason`` (``done``, ``signal``, ``time_budget``), ``checkpoint``.

On resume the file is cut back to the resumed step, so it always reads as one run.

With ``--tensorboard`` the same train and eval numbers also go to TensorBoard event files in
the run directory (``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``,
``train/step_time_s``, ``train/peak_mem_mib`` and ``train/rss_mib`` as the largest rank's,
``eval/loss``); on resume TensorBoard is told to drop the events after the resumed step.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["MetricsLog", "Progress", "plot", "read_metrics", "tensorboard_writer_class"]

_TB_TRAIN = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_mem_mib", "rss_mib")


def tensorboard_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``; ImportError with the fix if not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(
            "--tensorboard needs the tensorboard package: pip install 'fullshard[tensorboard]' "
            "(or pip install tensorboard), or drop --tensorboard"
        ) from None
    return SummaryWriter


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` (a torn last line, from a kill, is dropped)."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


class MetricsLog:
    """Appends records to ``metrics.jsonl``, flushed line by line (and to TensorBoard)."""

    def __init__(self, path: Path, *, resume_step: int, tensorboard: bool = False) -> None:
        self.path = path
        kept = [r for r in read_metrics(path) if int(r.get("step", 0)) <= resume_step]
        if resume_step == 0:
            kept = []
        text = "".join(json.dumps(r) + "\n" for r in kept)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text(text)
        tmp.replace(path)
        self._f: TextIO = path.open("a")
        self._tb: Any = None
        if tensorboard:  # purge_step: events of steps after the resumed one are stale
            writer = tensorboard_writer_class()
            self._tb = writer(log_dir=str(path.parent), purge_step=resume_step + 1)

    def write(self, kind: str, **fields: Any) -> None:
        """Append one record."""
        record = {"kind": kind, **fields, "time": round(time.time(), 3)}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb is not None and kind in ("train", "eval"):
            for name in _TB_TRAIN if kind == "train" else ("loss",):
                value = fields.get(name)
                if isinstance(value, list):  # per rank: the largest
                    value = max(value, default=None)
                if value is not None:
                    self._tb.add_scalar(f"{kind}/{name}", value, fields["step"], record["time"])
            self._tb.flush()

    def close(self) -> None:
        """Close the file (and the TensorBoard writer)."""
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _fmt_rate(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


class Progress:
    """Rank 0's console: a live one-line bar on a terminal, plain log lines otherwise."""

    def __init__(
        self,
        *,
        total: int,
        start: int,
        mode: str,
        log_every: int,
        time_budget: float = 0.0,
        out: TextIO | None = None,
    ) -> None:
        self.out = out or sys.stdout
        self.time_budget = time_budget  # seconds; 0: none
        self.bar = mode == "bar" or (mode == "auto" and self.out.isatty())
        self.total, self.start, self.log_every = total, start, log_every
        self._t0 = time.monotonic()
        self._bar_shown = False
        self.note = ""  # shown after each step's figures (e.g. torchft's quorum)

    def _eta(self, step: int) -> float:
        done, elapsed = step - self.start, time.monotonic() - self._t0
        left = elapsed / done * (self.total - step) if done > 0 else math.inf
        if self.time_budget:
            left = min(left, max(0.0, self.time_budget - elapsed))
        return left

    def step(self, rec: dict[str, Any]) -> None:
        """Show a train record (every step on a bar; every ``log_every`` steps as lines)."""
        step = int(rec["step"])
        mem = "/".join(f"{m:.0f}" for m in rec["peak_mem_mib"])
        text = (
            f"step {step:>{len(str(self.total))}}/{self.total}  loss {rec['loss']:.4f}  "
            f"{_fmt_rate(rec['tokens_per_s'])} tok/s  peak mem {mem} MiB  "
            f"eta {_fmt_duration(self._eta(step))}"
        )
        if self.note:
            text += f"  {self.note}"
        if rec.get("skipped"):
            text += "  (skipped: non-finite gradients)"
        if self.bar:
            width = 24
            filled = int(width * step / self.total)
            bar = "#" * filled + "-" * (width - filled)
            columns = shutil.get_terminal_size().columns
            line = f"[{bar}] {text}"[: max(20, columns - 1)]  # one row, so \r redraws it
            self.out.write(f"\r\x1b[2K{line}")
            self.out.flush()
            self._bar_shown = True
        elif self.log_every and (step % self.log_every == 0 or step == self.total):
            self.line(text)

    def line(self, text: str) -> None:
        """Print a full line (above the bar, which the next step redraws)."""
        if self._bar_shown:
            self.out.write("\r\x1b[2K")
            self._bar_shown = False
        self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self._bar_shown:
            self.out.write("\n")
            self.out.flush()
            self._bar_shown = False


def plot(metrics_path: Path, out_path: Path) -> None:
    """``loss.png``: train/eval loss and per-rank peak memory against step (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, (ax_loss, ax_mem) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    if evals:
        ax_loss.plot(
            [r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval", ms=4
        )
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.set_title(f"fullshard train: {metrics_path.parent.name}")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    n_ranks = max((len(r["peak_mem_mib"]) for r in train), default=0)
    for rank in range(n_ranks):
        pts = [(r["step"], r["peak_mem_mib"][rank]) for r in train if rank < len(r["peak_mem_mib"])]
        ax_mem.plot([s for s, _ in pts], [m for _, m in pts], label=f"rank {rank}", lw=1)
    ax_mem.set_xlabel("step")
    ax_mem.set_ylabel("peak memory (MiB)")
    if n_ranks:
        ax_mem.legend(ncol=min(n_ranks, 4), fontsize="small")
    ax_mem.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out_path.with_name(out_path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out_path)
