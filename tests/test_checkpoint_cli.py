"""``fullshard ckpt export`` streams: its peak RSS is bounded by the largest tensor, not the model.

Export runs in a subprocess that, after its imports, resets the kernel's peak-RSS counter
(``/proc/self/clear_refs``) and reports how far above its RSS at that point the peak went; that
growth must stay under a bound well below the model size.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import fullshard.checkpoint as ckpt
from fullshard.cli import main as fullshard_main

SRC = Path(__file__).parent.parent / "src"
MiB = 1 << 20
N_TENSORS, ROWS, COLS = 8, 2048, 2048  # 8 x 16 MiB float32 = 128 MiB model

_PROBE = """
import re, sys
import fullshard.checkpoint.export  # (and torch) which main imports once its flags are parsed
from fullshard.checkpoint.cli import main

def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM (peak RSS) to the current RSS
base = status("VmRSS")
rc = main(sys.argv[1:])
print("GROWTH_KB", status("VmHWM") - base, "RC", rc)
"""


def _peak_growth(*argv: str) -> int:
    """Bytes by which the peak RSS of ``fullshard ckpt *argv`` exceeds its RSS after imports."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], env=env, capture_output=True, text=True, check=True
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("GROWTH_KB"))
    _, kb, _, rc = line.split()
    assert rc == "0", out
    return int(kb) * 1024


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_export_peak_rss_is_bounded_by_the_largest_tensor(tmp_path: Path) -> None:
    model = nn.ParameterDict(
        {f"w{i}": nn.Parameter(torch.full((ROWS, COLS), float(i))) for i in range(N_TENSORS)}
    )
    ckpt.save(tmp_path / "ckpt", model=model)
    del model
    largest = ROWS * COLS * 4
    total = N_TENSORS * largest
    growth = _peak_growth("export", str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))
    bound = largest + 16 * MiB  # the one tensor being assembled, plus a small constant
    assert bound < total / 2  # the test can tell streaming from loading the whole model
    assert growth < bound, (
        f"export peak RSS grew {growth / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB, "
        f"model {total / MiB:.0f} MiB"
    )
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(f"w{i}" for i in range(N_TENSORS))
        assert torch.equal(f.get_slice("w5")[7:9], torch.full((2, COLS), 5.0))


def test_dispatcher_routes_ckpt_and_reports_errors(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert fullshard_main(["ckpt", "inspect", str(tmp_path)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    model = nn.Linear(3, 5)
    ckpt.save(tmp_path / "run" / "checkpoints" / "step_00000002", model=model, extra={"step": 2})
    assert fullshard_main(["ckpt", "inspect", "--no-verify", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "step: 2" in out and "weight  float32  [5, 3]" in out and "not verified" in out
