"""``scripts/fsdp1_upstream.py`` (torch's FSDP1 or FSDP2 tests under torch's FSDP or fullshard)
on synthetic test files made here, not torch's: its counting (a skip is a skip, never a pass),
the engine swap (``FullyShardedDataParallel`` and ``fully_shard``) in the pytest process and in
every rank torch's ``FSDPTest`` spawns, the CPU run of a ``skip_if_lt_x_gpu(2)`` test and of one
written for CUDA by name, the tests that pass under torch but not under fullshard, and
``--suite fsdp2``'s default files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "fsdp1_upstream.py"

SYNTHETIC = """
import os
import unittest

import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_distributed import skip_if_lt_x_gpu
from torch.testing._internal.common_fsdp import FSDPTest


def _is_fullshard():
    return FSDP.__module__.startswith("fullshard")


class TestLocal(unittest.TestCase):
    def test_passes(self):
        pass

    def test_fails(self):
        self.assertEqual(1, 2, "synthetic failure")

    @unittest.skip("synthetic skip")
    def test_skipped(self):
        pass

    def test_torch_only(self):
        self.assertFalse(_is_fullshard(), "fullshard's class")


class TestRanks(FSDPTest):
    @property
    def world_size(self):
        return 2

    @skip_if_lt_x_gpu(2)
    def test_rank_engine(self):
        want = os.environ["FULLSHARD_UPSTREAM_ENGINE"] == "fullshard"
        self.assertEqual(_is_fullshard(), want)
        self.assertEqual(fully_shard.__module__.startswith("fullshard"), want)
        self.assertEqual(dist.get_world_size(), 2)

    def test_rank_skips(self):
        raise unittest.SkipTest("skipped in a rank")

    @skip_if_lt_x_gpu(2)
    def test_cuda_named(self):
        # written for CUDA by name: runs on the CPU under both engines
        import torch
        from torch import nn
        from torch.testing._internal.common_fsdp import CUDAInitMode, DEVICEInitMode

        torch.cuda.set_device(self.rank)
        self.assertIs(CUDAInitMode.CUDA_BEFORE, DEVICEInitMode.DEVICE_BEFORE)
        fsdp = FSDP(nn.Linear(4, 4).cuda(), device_id=self.rank)
        x = torch.randn(2, 4, device="cuda").cuda()
        y = torch.ones(2, 4, device=torch.cuda.current_device()).to(torch.device("cuda", 0))
        fsdp(x + y).sum().backward()
        self.assertEqual({x.device.type, y.device.type}, {"cpu"})
        with self.assertRaises(RuntimeError):  # a GPU feature still fails
            torch.ones(1).pin_memory()
"""


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fsdp1_upstream", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fsdp1_upstream"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_both_engines_counted_on_a_synthetic_file(tmp_path: Path) -> None:
    tests_dir = tmp_path / "fsdp"
    tests_dir.mkdir()
    (tests_dir / "test_synthetic.py").write_text(SYNTHETIC)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--tests-dir", str(tests_dir), "--out", str(out)]
    cmd += ["--files", "test_synthetic.py", "--test-timeout", "120", "--file-timeout", "400"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((out / "summary.json").read_text())
    by_engine = data["files"]["test_synthetic.py"]
    counts = {
        e: (r["passed"], r["failed"], r["errors"], r["skipped"]) for e, r in by_engine.items()
    }
    # torch: passes, torch_only, rank_engine, cuda_named | fails | - | skipped, rank_skips
    assert counts == {"torch": (4, 1, 0, 2), "fullshard": (3, 2, 0, 2)}, counts
    for r in by_engine.values():
        passed = {t.split("::")[-1] for t in r["passed_tests"]}
        skipped = {t.split("::")[-1].split(":")[0] for t in r["skipped_tests"]}
        assert skipped == {"test_skipped", "test_rank_skips"}
        assert not passed & skipped  # a skip is never a pass
        assert "test_rank_engine" in passed  # ran on the CPU, in both ranks, under its engine
        assert "test_cuda_named" in passed  # CUDA by name means the CPU, under both engines
    fails = {f["test"].split("::")[-1]: f["first_line"] for f in by_engine["fullshard"]["failures"]}
    assert "synthetic failure" in fails["test_fails"]
    assert "fullshard's class" in fails["test_torch_only"]
    assert [r["test"].split("::")[-1] for r in data["regressions"]] == ["test_torch_only"]
    md = (out / "summary.md").read_text()
    assert "| test_synthetic.py | torch | 4 | 1 | 0 | 2 |" in md
    assert "| test_synthetic.py | fullshard | 3 | 2 | 0 | 2 |" in md


def test_junit_counting_and_a_rank_error_first_line(tmp_path: Path) -> None:
    mod = _load()
    xml = tmp_path / "r.xml"
    rank_error = (
        "RuntimeError: Process 1 exited with error code 10 and exception:\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 3, in f\n'
        "ValueError: the real cause\n"
    )
    root = ET.Element("testsuites")
    suite = ET.SubElement(root, "testsuite")
    ET.SubElement(suite, "testcase", classname="m.C", name="test_ok")
    skip = ET.SubElement(suite, "testcase", classname="m.C", name="test_skip")
    ET.SubElement(skip, "skipped", message="Need at least 2 CUDA devices")
    bad = ET.SubElement(suite, "testcase", classname="m.C", name="test_bad")
    ET.SubElement(bad, "failure", message="RuntimeError: Process 1 exited").text = rank_error
    err = ET.SubElement(suite, "testcase", classname="m.C", name="test_err")
    ET.SubElement(err, "error", message="ImportError: no module x")
    thread = ET.SubElement(suite, "testcase", classname="m.C", name="test_thread")
    thread_error = rank_error.replace(
        "Process 1 exited with error code 10 and", "Thread 1 exited with"
    )
    ET.SubElement(thread, "failure", message="RuntimeError: Thread 1").text = thread_error
    ET.ElementTree(root).write(xml)
    r = mod.parse_junit(xml)
    assert (r.passed, r.failed, r.errors, r.skipped) == (1, 2, 1, 1)
    assert r.passed_tests == ["m.C::test_ok"]
    assert r.skipped_tests == ["m.C::test_skip: Need at least 2 CUDA devices"]
    assert [f.first_line for f in r.failures] == [
        "ValueError: the real cause",
        "ImportError: no module x",
        "ValueError: the real cause",  # a thread rank's (FSDPTestMultiThread)
    ]


def test_bad_tests_dir_is_one_clear_line(tmp_path: Path, capsys: object) -> None:
    mod = _load()
    assert mod.main(["--tests-dir", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "--tests-dir" in err and "test/distributed/fsdp" in err


FSDP2_FILE = """
import os
import unittest

from torch.distributed.fsdp import fully_shard


class TestState(unittest.TestCase):
    def test_engine(self):
        want = os.environ["FULLSHARD_UPSTREAM_ENGINE"] == "fullshard"
        self.assertEqual(fully_shard.__module__.startswith("fullshard"), want)
"""


def test_fsdp2_suite_runs_fsdp2_default_files(tmp_path: Path, capsys: object) -> None:
    mod = _load()
    tests_dir = tmp_path / "fsdp2"
    tests_dir.mkdir()
    (tests_dir / "test_fully_shard_state.py").write_text(FSDP2_FILE)
    (tests_dir / "test_wrap.py").write_text(FSDP2_FILE)  # an FSDP1 name: not in the suite
    out = tmp_path / "out"
    argv = ["--suite", "fsdp2", "--tests-dir", str(tests_dir), "--out", str(out)]
    assert mod.main([*argv, "--engine", "fullshard", "--src", str(ROOT / "src")]) == 0
    data = json.loads((out / "summary.json").read_text())
    assert list(data["files"]) == ["test_fully_shard_state.py"]
    assert data["files"]["test_fully_shard_state.py"]["fullshard"]["passed"] == 1
    assert data["meta"]["suite"] == "fsdp2"
    assert (out / "summary.md").read_text().startswith("# torch's FSDP2 tests")
    assert mod.main(["--suite", "fsdp2", "--tests-dir", str(tmp_path / "no"), "--out", str(out)])
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "test/distributed/_composable/fsdp" in err
