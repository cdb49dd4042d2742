"""Run PyTorch's own FSDP1 or FSDP2 tests on CPU/gloo under torch's FSDP or under fullshard.

    python scripts/fsdp1_upstream.py --tests-dir DIR                     # both engines
    python scripts/fsdp1_upstream.py --tests-dir DIR --engine fullshard \\
        --files test_fsdp_grad_acc.py -k use_orig_params --out /tmp/fsdp1-up
    python scripts/fsdp1_upstream.py --tests-dir DIR --src ../other-checkout/src  # its fullshard
    python scripts/fsdp1_upstream.py --suite fsdp2 --tests-dir DIR2      # FSDP2's files

``DIR`` holds torch's ``test/distributed/fsdp/*.py`` (FSDP1, ``--suite fsdp1``, the default) or
``DIR2`` its ``test/distributed/_composable/fsdp/*.py`` (FSDP2, ``--suite fsdp2``) of the
installed torch version (this script downloads nothing); the suite only picks the default
``--files``. Each chosen file runs under pytest in its own process, once per engine:

* ``torch``: torch's ``FullyShardedDataParallel`` / ``fully_shard`` (the control);
* ``fullshard``: the same tests with ``fullshard.patch_torch_fsdp()`` applied first, so every
  ``FSDP(...)`` they build is fullshard's wrapper and every ``fully_shard(...)`` fullshard's
  (FSDP2's tests that reach into FSDP2's private modules, ``FSDPParamGroup`` or its autograd
  functions, still see torch's, which fullshard never runs).

The swap must happen in every process, before the test module imports FSDP, also in the ranks
that torch's ``MultiProcessTestCase`` spawns: the script writes a ``sitecustomize.py`` into
``OUT/logs/boot``, put first on ``PYTHONPATH``, which calls :func:`boot` at every interpreter's
start. :func:`boot` also makes torch's tests run on a machine without accelerators, where they
otherwise skip or are never instantiated:

* ``skip_if_lt_x_gpu`` runs the test (as its own ``allow_cpu=True`` does), and ``FSDPTest``'s
  rank entry point drops its "fewer accelerators than ranks" skip (gloo, every rank on the CPU;
  ``FSDPTestMultiThread``'s thread ranks need nothing);
* ``common_fsdp.DEVICE_COUNT`` (``FSDPTest``'s default world size, 1 on a CPU),
  ``torch.cpu.device_count()`` and ``torch.accelerator.device_count()`` (which test classes
  size their world by) answer ``--world-size``;
* ``instantiate_device_type_tests(..., only_for=<accelerators>)`` also makes the CPU variant,
  and ``common_cuda.TEST_MULTIGPU`` (``unittest.skipIf(not TEST_MULTIGPU)``) is true;
* DDP, the reference many tests compare against, gets no ``device_ids`` for a CPU module
  (it refuses them there), and torch's FSDP1 (the control), which refuses a CPU module
  without ``device_id`` when no accelerator exists, gets the CPU device where a test passes
  none (fullshard's wrapper runs on the CPU without one; it is not touched);
* tests written for CUDA by name run on the CPU, the same way under both engines: ``.cuda()``
  of a tensor or module is the identity, ``device="cuda"`` / ``torch.device("cuda")`` / a
  ``device=`` index given to a torch function (``torch.randn``, ``nn.Linear``, ``.to``) means
  the CPU (a torch function mode held for the process's life), ``torch.cuda.set_device`` does
  nothing, ``torch.cuda.current_device()`` is 0, ``common_fsdp.CUDAInitMode`` names
  ``DEVICEInitMode``'s members (``CUDA_BEFORE`` ...), and a CUDA ``device_id`` (an index such
  as ``self.rank``, ``"cuda"``) given to the class under test, torch's or fullshard's, is
  ``torch.device("cpu")``. What needs a GPU feature (pinned memory, streams, NCCL) still fails,
  under both: the control shows it, and it is not counted as passing torch.

The device type and backend are already CPU/gloo there (``common_fsdp`` picks ``cpu``/``gloo``
without an accelerator, as do the tests' ``device_type = acc.type if acc else "cpu"``). Tests
that still need CUDA fail under both engines, which the control shows. A skip that remains
(``unittest.skip``, a version guard, a rank's skip exit code) is counted as a skip, never as a
pass. Needs torch's test helpers' one extra package, ``expecttest`` (in the ``dev`` extra).

Per-test limit: torch's own (``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``, set from
``--test-timeout``) fails a test whose ranks hang. Per-file limit: ``--file-timeout``; a file
past it is killed, its finished tests are read from pytest's verbose lines and the rest
count as one error (``FILE::<rest>``).

Output (``--out``, default ``./fsdp1-upstream``): ``summary.json`` (per file and engine:
passed / failed / errors / skipped / seconds, each failing test's id and the first line of its
error) and ``summary.md`` (the same as tables, and the tests that pass under torch but not under
fullshard); ``OUT/logs`` keeps pytest's output and JUnit XML per file and engine. Exit
status 0 whatever the tests did (a measurement), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("torch", "fullshard")
# The areas of torch's tests measured by default, per suite (those present in --tests-dir run).
FSDP1_FILES = (
    "test_wrap.py",
    "test_fsdp_core.py",
    "test_fsdp_misc.py",
    "test_fsdp_state_dict.py",
    "test_fsdp_ignored_modules.py",
    "test_fsdp_mixed_precision.py",
    "test_fsdp_use_orig_params.py",
    "test_fsdp_fine_tune.py",
    "test_fsdp_freezing_weights.py",
    "test_fsdp_optim_state.py",
    "test_fsdp_grad_acc.py",
    "test_fsdp_clip_grad_norm.py",
    "test_fsdp_summon_full_params.py",
)
FSDP2_FILES = (
    "test_fully_shard_autograd.py",
    "test_fully_shard_frozen.py",
    "test_fully_shard_comm.py",
    "test_fully_shard_training.py",
    "test_fully_shard_mixed_precision.py",
    "test_fully_shard_state.py",
)
SUITES = {"fsdp1": FSDP1_FILES, "fsdp2": FSDP2_FILES}
SUITE_DIRS = {"fsdp1": "test/distributed/fsdp", "fsdp2": "test/distributed/_composable/fsdp"}
ENV_ENGINE = "FULLSHARD_UPSTREAM_ENGINE"
ENV_WORLD = "FULLSHARD_UPSTREAM_WORLD_SIZE"
_SITECUSTOMIZE = """\
import os
if os.environ.get({env!r}):
    import sys
    sys.path.insert(0, {scripts!r})
    import fsdp1_upstream
    fsdp1_upstream.boot()
"""
# pytest -v: "file.py::Class::test PASSED [ 10%]"
_ERROR_LINE = re.compile(r"^[\w.]+(Error|Exception|Warning)\b")
_RANK_EXITED = re.compile(r"(Process|Thread) \d+ exited with (error code|exception)")
_VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)\b")


def boot() -> None:
    """In a test process: force CPU-capable runs and apply the engine named by the env."""
    from torch.testing._internal import common_distributed, common_fsdp

    world = int(os.environ.get(ENV_WORLD, "2"))
    if common_fsdp.DEVICE_TYPE == "cpu":
        common_fsdp.DEVICE_COUNT = world
    original = common_distributed.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = False) -> Any:
        return original(x, allow_cpu=True)

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu
    if common_fsdp.DEVICE_TYPE == "cpu":
        _instantiate_on_cpu(world)
        # the spawned ranks unpickle it by the name it replaces
        _run_rank_on_cpu.__name__ = _run_rank_on_cpu.__qualname__ = "_run"
        common_fsdp.FSDPTest._run = classmethod(_run_rank_on_cpu)  # type: ignore[assignment]
    if os.environ.get(ENV_ENGINE) == "fullshard":
        import fullshard

        fullshard.patch_torch_fsdp()
    if common_fsdp.DEVICE_TYPE == "cpu":
        _cuda_as_cpu()
        _device_id_as_cpu()


def _instantiate_on_cpu(world: int) -> None:
    """Device-generic test classes get their CPU variant too (files that list only
    accelerators in ``only_for``), and ``torch.cpu.device_count()`` and
    ``torch.accelerator.device_count()`` (which test classes size their world by) answer
    ``world``."""
    import torch
    from torch.testing._internal import common_cuda, common_device_type

    original = common_device_type.instantiate_device_type_tests

    def instantiate_device_type_tests(*args: Any, **kwargs: Any) -> Any:
        only_for = kwargs.get("only_for")
        if only_for is not None and "cpu" not in only_for:
            only_for = [only_for] if isinstance(only_for, str) else list(only_for)
            kwargs["only_for"] = [*only_for, "cpu"]
        return original(*args, **kwargs)

    common_device_type.instantiate_device_type_tests = instantiate_device_type_tests
    common_cuda.TEST_MULTIGPU = True  # read by ``unittest.skipIf`` at the test's import
    _ddp_on_cpu()
    _torch_fsdp1_on_cpu()
    torch.cpu.device_count = lambda: world
    torch.accelerator.device_count = lambda: world


def _ddp_on_cpu() -> None:
    """DDP, the reference many tests train against, refuses ``device_ids`` for a module on the
    CPU (where it must be ``None``): drop them there, the same under both engines."""
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__

    def __init__(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        if all(p.device.type == "cpu" for p in module.parameters()):
            kwargs.pop("device_ids", None)
            kwargs.pop("output_device", None)
            args = (None, None, *args[2:]) if args else ()  # device_ids, output_device
        original(self, module, *args, **kwargs)

    DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]


def _torch_fsdp1_on_cpu() -> None:
    """torch's FSDP1 (the control) refuses a CPU module without ``device_id`` when no
    accelerator exists, yet runs on the CPU given ``device_id=torch.device("cpu")``: its device
    handle gets the CPU where a test passes no ``device_id``. fullshard's wrapper is not
    touched (it runs on the CPU without one)."""
    import torch
    from torch.distributed.fsdp import fully_sharded_data_parallel as torch_fsdp1

    original = torch_fsdp1._init_device_handle

    def _init_device_handle(state: Any, module: Any, ignored: Any, device_id: Any) -> Any:
        if device_id is None and torch.accelerator.current_accelerator() is None:
            device_id = torch.device("cpu")
        return original(state, module, ignored, device_id)

    torch_fsdp1._init_device_handle = _init_device_handle


def _cuda_as_cpu() -> None:
    """Older tests build on CUDA by name: ``.cuda()`` of a tensor or module, ``device="cuda"``
    or ``torch.device("cuda")`` given to a torch function (``torch.randn``, ``nn.Linear``,
    ``.to``), ``torch.cuda.set_device`` / ``current_device``, ``CUDAInitMode``. Without an
    accelerator these mean the CPU, in every process and the same under both engines (a torch
    function mode rewrites the device); what else needs CUDA (streams, pinned memory, NCCL)
    still fails, under both."""
    import torch
    from torch.testing._internal import common_fsdp

    torch.cuda.set_device = lambda device: None
    torch.cuda.current_device = lambda: 0
    modes = common_fsdp.DEVICEInitMode
    cuda_modes = {f"CUDA_{m.name[len('DEVICE_') :]}": m for m in modes}
    common_fsdp.CUDAInitMode = type("CUDAInitMode", (), cuda_modes)  # type: ignore[attr-defined]
    _cuda_as_cpu_mode().__enter__()  # for the process's life


def _is_cuda(value: Any) -> bool:
    import torch

    if isinstance(value, str):
        return value.split(":")[0] == "cuda"
    return isinstance(value, torch.device) and value.type == "cuda"


def _cuda_as_cpu_mode() -> Any:
    """A torch function mode mapping CUDA to the CPU (see :func:`_cuda_as_cpu`)."""
    from torch.overrides import TorchFunctionMode

    class CudaAsCpu(TorchFunctionMode):
        """``Tensor.cuda`` is the identity; a CUDA device (or a ``device=`` index) is the CPU."""

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            import torch

            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                return args[0]
            device = kwargs.get("device")  # an index is an accelerator's
            if _is_cuda(device) or (isinstance(device, int) and not isinstance(device, bool)):
                kwargs["device"] = "cpu"
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
            return func(*args, **kwargs)

    return CudaAsCpu()


def _device_id_as_cpu() -> None:
    """A CUDA ``device_id`` (an index such as ``self.rank``, ``"cuda"``, a CUDA device) given
    to the FSDP1 class under test, torch's or fullshard's, means the CPU: the same patch of
    ``__init__`` on whichever class ``torch.distributed.fsdp.FullyShardedDataParallel`` is."""
    import torch
    import torch.distributed.fsdp as fsdp

    cls = fsdp.FullyShardedDataParallel
    original = cls.__init__

    def __init__(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        dev = kwargs.get("device_id")
        if dev is not None and (isinstance(dev, int) or torch.device(dev).type == "cuda"):
            kwargs["device_id"] = torch.device("cpu")
        original(self, module, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]


def _run_rank_on_cpu(
    cls: Any, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any
) -> None:
    """``FSDPTest``'s rank entry point without its "fewer accelerators than ranks" skip (every
    rank on the CPU, gloo); the rest as torch's: one process group for the test, barriers
    around it."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.common_utils import set_rng_seed

    self = cls(test_name)
    self.rank = rank
    self.file_name = file_name
    world = int(self.world_size)
    if kwargs.get("fake_pg", False):
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group(backend="fake", world_size=world, rank=rank, store=FakeStore())
    else:
        dist.init_process_group(
            init_method=self.init_method, backend="gloo", world_size=world, rank=rank
        )
    dist.barrier()
    torch._dynamo.reset()
    set_rng_seed()
    self.run_test(test_name, pipe)
    torch._dynamo.reset()
    dist.barrier()
    dist.destroy_process_group()


@dataclass
class Failure:
    """One test that did not pass: its id and the first line of its error."""

    test: str
    kind: str  # "failed" | "error" | "not run"
    first_line: str


@dataclass
class FileResult:
    """One file under one engine."""

    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    timed_out: bool = False
    passed_tests: list[str] = field(default_factory=list)
    skipped_tests: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    def add(self, test: str, outcome: str, message: str = "") -> None:
        """Count one test's ``outcome`` (passed / skipped / failed / error)."""
        if outcome == "passed":
            self.passed += 1
            self.passed_tests.append(test)
        elif outcome == "skipped":
            self.skipped += 1
            self.skipped_tests.append(f"{test}: {_first_line(message)}")
        else:
            if outcome == "failed":
                self.failed += 1
            else:
                self.errors += 1
            self.failures.append(Failure(test, outcome, _first_line(message)))


def _first_line(message: str) -> str:
    # pytest marks a traceback's error lines with a leading "E"
    lines = [re.sub(r"^E\s+", "", ln.strip()) for ln in message.splitlines() if ln.strip()]
    # torch's MultiProcessTestCase reports a rank's exception as "Process N exited with error
    # code 10 and exception:" (MultiThreadedTestCase: "Thread N exited with exception:") then
    # the traceback: its last line names the error
    for i, ln in enumerate(lines):
        if _RANK_EXITED.search(ln):
            rest = lines[i + 1 :]
            end = next((k for k, x in enumerate(rest) if _RANK_EXITED.search(x)), None)
            errs = [x for x in rest[:end] if _ERROR_LINE.match(x)]
            if errs:  # the traceback's last error line (the cause, not its re-raise)
                return errs[-1][:300]
    return (lines[0] if lines else "")[:300]


def _message(element: ET.Element) -> str:
    """A JUnit failure's message, with its text (where a rank's traceback lies)."""
    return f"{element.get('message') or ''}\n{element.text or ''}"


def _test_id(case: ET.Element) -> str:
    module = case.get("classname", "")
    return f"{module}::{case.get('name', '')}"


def parse_junit(path: Path) -> FileResult:
    """Read pytest's JUnit XML into a :class:`FileResult`."""
    result = FileResult()
    for case in ET.parse(path).getroot().iter("testcase"):
        test = _test_id(case)
        failure, error, skip = case.find("failure"), case.find("error"), case.find("skipped")
        if failure is not None:
            result.add(test, "failed", _message(failure))
        elif error is not None:
            result.add(test, "error", _message(error))
        elif skip is not None:
            result.add(test, "skipped", skip.get("message") or "")
        else:
            result.add(test, "passed")
    return result


def parse_verbose(stdout: str) -> FileResult:
    """Outcomes from pytest's ``-v`` lines (a file killed before its JUnit XML was written)."""
    result = FileResult()
    for line in stdout.splitlines():
        m = _VERBOSE_LINE.match(line.strip())
        if m:
            outcome = {"PASSED": "passed", "SKIPPED": "skipped", "FAILED": "failed"}
            result.add(m.group(1), outcome.get(m.group(2), "error"), "see the log")
    return result


def _env(engine: str, boot_dir: Path, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(boot_dir), str(args.src.resolve()), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    env[ENV_ENGINE] = engine
    env[ENV_WORLD] = str(args.world_size)
    env["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.test_timeout)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_file(test_file: Path, engine: str, args: argparse.Namespace, work: Path) -> FileResult:
    """Run one test file under one engine; never raises for what the tests do."""
    boot_dir = work / "boot"
    boot_dir.mkdir(exist_ok=True)
    code = _SITECUSTOMIZE.format(env=ENV_ENGINE, scripts=str(Path(__file__).resolve().parent))
    (boot_dir / "sitecustomize.py").write_text(code)
    junit = work / f"{test_file.stem}.{engine}.xml"
    log = work / f"{test_file.stem}.{engine}.log"
    cmd = [sys.executable, "-m", "pytest", test_file.name, "-v", "-p", "no:cacheprovider"]
    cmd += ["--rootdir", str(test_file.parent), f"--junitxml={junit}", "-o", "addopts="]
    if args.k:
        cmd += ["-k", args.k]
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=test_file.parent,
            env=_env(engine, boot_dir, args),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=args.file_timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
    text = log.read_text(errors="replace")
    if junit.exists() and not timed_out:
        result = parse_junit(junit)
    else:
        result = parse_verbose(text)
    if not junit.exists() and not timed_out and not result.passed_tests:
        # pytest died before running anything (an import error): one error for the file
        tail = [ln for ln in text.splitlines() if ln.startswith("E ")][:1] or text.splitlines()[-1:]
        result.add(f"{test_file.name}::<collection>", "error", "\n".join(tail))
    result.timed_out = timed_out
    if timed_out:
        result.add(f"{test_file.name}::<rest>", "error", f"file killed after {args.file_timeout}s")
    result.seconds = round(time.monotonic() - start, 1)
    return result


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    def git(*a: str) -> str:
        done = subprocess.run(["git", *a], cwd=args.src.resolve(), capture_output=True, text=True)
        return done.stdout.strip()

    return {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", ""),
        "fullshard_commit": git("rev-parse", "--short", "HEAD"),
        "fullshard_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "fullshard_src": str(args.src.resolve()),
        "world_size": args.world_size,
        "suite": args.suite,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def regressions(files: dict[str, dict[str, FileResult]]) -> list[tuple[str, Failure]]:
    """(file, failure) for each test that passes under torch and not under fullshard."""
    out = []
    for name, by_engine in files.items():
        if "torch" not in by_engine or "fullshard" not in by_engine:
            continue
        passed_torch = set(by_engine["torch"].passed_tests)
        out += [(name, f) for f in by_engine["fullshard"].failures if f.test in passed_torch]
    return out


def render_markdown(meta: dict[str, Any], files: dict[str, dict[str, FileResult]]) -> str:
    """The summary as markdown: a table per engine, then the tests only torch passes."""
    lines = [
        f"# torch's {meta['suite'].upper()} tests, {meta['date']}",
        "",
        f"torch {meta['torch']} ({meta['torch_git'][:10]}), fullshard {meta['fullshard_commit']}"
        f"{' (dirty)' if meta['fullshard_dirty'] else ''}, world size {meta['world_size']}: "
        f"`{meta['command']}`",
        "",
        "| file | engine | passed | failed | errors | skipped | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, by_engine in files.items():
        for engine, r in by_engine.items():
            note = " (timed out)" if r.timed_out else ""
            lines.append(
                f"| {name} | {engine} | {r.passed} | {r.failed} | {r.errors} | {r.skipped} "
                f"| {r.seconds}{note} |"
            )
    lines += ["", "## Passing under torch, not under fullshard", ""]
    lines += [f"- `{f.test}`: {f.first_line}" for _, f in regressions(files)] or ["(none)"]
    for engine in ENGINES:
        lines += ["", f"## Failures under {engine}", ""]
        for by_engine in files.values():
            failures = by_engine[engine].failures if engine in by_engine else []
            lines += [f"- `{f.test}` ({f.kind}): {f.first_line}" for f in failures]
    return "\n".join(lines) + "\n"


def write_summary(out: Path, meta: dict[str, Any], files: dict[str, dict[str, FileResult]]) -> None:
    """Write ``summary.json`` and ``summary.md`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "meta": meta,
        "files": {n: {e: asdict(r) for e, r in by.items()} for n, by in files.items()},
        "regressions": [{"file": n, **asdict(f)} for n, f in regressions(files)],
    }
    (out / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "summary.md").write_text(render_markdown(meta, files))


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--tests-dir", type=Path, required=True, help="torch's tests of --suite")
    p.add_argument("--suite", choices=sorted(SUITES), default="fsdp1", help="default --files")
    p.add_argument("--engine", choices=[*ENGINES, "both"], default="both")
    p.add_argument("--files", nargs="+", help="file names in --tests-dir (default: the areas)")
    p.add_argument("-k", help="pytest -k expression, applied to every file")
    p.add_argument("--world-size", type=int, default=2, help="FSDPTest's default world size")
    p.add_argument("--test-timeout", type=int, default=300, help="seconds a test may take")
    p.add_argument("--file-timeout", type=int, default=1800, help="seconds a file may take")
    p.add_argument("--out", type=Path, default=Path("fsdp1-upstream"))
    p.add_argument("--src", type=Path, default=ROOT / "src", help="fullshard's tree to measure")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen files under the chosen engines and write the summary."""
    args = _args(argv)
    tests_dir: Path = args.tests_dir.resolve()
    names = args.files or [n for n in SUITES[args.suite] if (tests_dir / n).exists()]
    missing = [n for n in names if not (tests_dir / n).is_file()]
    if not tests_dir.is_dir() or missing or not names:
        what = missing or [str(tests_dir)]
        print(
            f"fsdp1_upstream: no test file {what}: pass --tests-dir holding torch's "
            f"{SUITE_DIRS[args.suite]}/*.py (and --files names in it)",
            file=sys.stderr,
        )
        return 2
    engines = ENGINES if args.engine == "both" else (args.engine,)
    files: dict[str, dict[str, FileResult]] = {}
    logs = args.out / "logs"  # pytest's output and JUnit XML, per file and engine
    logs.mkdir(parents=True, exist_ok=True)
    for name in names:
        for engine in engines:
            r = run_file(tests_dir / name, engine, args, logs.resolve())
            files.setdefault(name, {})[engine] = r
            print(
                f"{name} [{engine}]: {r.passed} passed, {r.failed} failed, "
                f"{r.errors} errors, {r.skipped} skipped ({r.seconds}s)",
                flush=True,
            )
            write_summary(args.out, _meta(args), files)
    print(f"summary: {args.out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
