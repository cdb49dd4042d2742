"""fullshard train, in-process and fast: config, presets, flags, validation, data sampling, metrics."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from fullshard.train import cli, launch
from fullshard.train import data as data_mod
from fullshard.train.config import ConfigError, TrainConfig, field_help, flag, to_toml
from fullshard.train.metrics import MetricsLog, Progress, read_metrics
from fullshard.train.optim import lr_at
from fullshard.train.presets import PRESETS, get_preset

# ---------------------------------------------------------------- config, presets, flags


def test_every_field_is_a_documented_flag() -> None:
    helps = field_help()
    text = cli.build_parser().format_help()
    for f in fields(TrainConfig):
        assert helps.get(f.name), f"{f.name} has no docstring (it becomes --help)"
        assert flag(f.name) in text, f"{flag(f.name)} missing from --help"
    required = "--preset --nproc --max-steps --run-dir --ckpt-every --resume --seed"
    required += " --max-restarts --mixed-precision --hf-config --data --config"
    for name in required.split():
        assert name in text


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_valid(name: str) -> None:
    cfg = get_preset(name)
    assert cfg.preset == name
    assert cfg.global_batch % cfg.micro_batch == 0


def test_unknown_preset_suggests() -> None:
    with pytest.raises(ConfigError, match=r"--preset.*'tiny'"):
        get_preset("tinny")


def test_precedence_defaults_preset_toml_flags(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('preset = "tiny"\nmax-steps = 7\nlr = 1\nrun_dir = "x"\n')
    cfg = cli.parse_config(["--config", str(toml), "--lr", "0.5"])
    assert cfg.preset == "tiny" and cfg.n_layer == 2  # from the preset named in the file
    assert cfg.max_steps == 7 and cfg.run_dir == "x"  # from the file
    assert cfg.lr == 0.5  # flags win
    assert cli.parse_config(["--preset", "tiny", "--no-tie-embeddings"]).tie_embeddings is False


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = cli.parse_config(["--preset", "llama-1b", "--sample-prompt", 'a "quoted"\nline'])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    again = cli.parse_config(["--config", str(path)])
    assert again == cfg


def test_toml_errors_name_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("max_stepz = 3\n")
    with pytest.raises(ConfigError, match="max_stepz"):
        cli.parse_config(["--config", str(bad)])
    with pytest.raises(ConfigError, match="--config"):
        cli.parse_config(["--config", str(tmp_path / "missing.toml")])


def test_lr_schedule() -> None:
    kw = {"lr": 1.0, "warmup": 10, "total": 110, "min_ratio": 0.1}
    assert lr_at(5, **kw) == pytest.approx(0.5)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(110, **kw) == pytest.approx(0.1)


def test_worker_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert not cli.in_torchrun()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert cli.in_torchrun()


# ---------------------------------------------------------------- bad input, before any spawn


def _fails(args: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    rc = cli.main(args)
    err = capsys.readouterr().err
    assert rc != 0, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in: {err}"


def test_bad_values_fail_fast(
    tmp_path: Path, no_launch: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    run = ["--preset", "tiny", "--run-dir", str(tmp_path / "run")]
    _fails(["--preset", "huge"], capsys, "--preset", "invalid choice")
    _fails([*run, "--max-steps", "-5"], capsys, "--max-steps", "positive")
    _fails([*run, "--max-steps", "ten"], capsys, "--max-steps", "invalid int")
    _fails([*run, "--lr", "0"], capsys, "--lr")
    _fails([*run, "--data", str(tmp_path / "nope.txt")], capsys, "--data", "does not exist")
    (tmp_path / "empty").mkdir()
    _fails([*run, "--data", str(tmp_path / "empty")], capsys, "--data", "empty")
    (tmp_path / "short.txt").write_text("hi")
    _fails([*run, "--data", str(tmp_path / "short.txt")], capsys, "--data", "too few")
    _fails([*run, "--nproc", "3"], capsys, "--global-batch 8", "3 x 2 = 6", "--global-batch 12")
    _fails([*run, "--global-batch", "9"], capsys, "--global-batch 9", "divisible")
    _fails([*run, "--d-model", "65"], capsys, "--d-model", "--n-head")
    (tmp_path / "file").write_text("x")
    unwritable = ["--preset", "tiny", "--run-dir", str(tmp_path / "file" / "run")]
    _fails(unwritable, capsys, "--run-dir", "cannot be created in", "(a file, not a directory)")
    _fails([*run, "--max-stepz", "3"], capsys, "--max-stepz", "did you mean --max-steps")
    _fails([*run, "--hf-config", "{not json"], capsys, "--hf-config")
    _fails([*run, "--hf-config", '{"hidden_size": 8}'], capsys, "--hf-config", "model_type")
    _fails([*run, "--resume", str(tmp_path / "nockpt")], capsys, "--resume")
    fake = tmp_path / "run" / "checkpoints" / "step_00000001"
    fake.mkdir(parents=True)
    _fails([*run, "--resume", str(fake)], capsys, "--resume", "not a complete checkpoint")
    (fake / "manifest.json").write_text("{}")  # complete, as far as listing goes
    _fails([*run, "--resume", "never"], capsys, "--resume never", "--resume auto")
    assert no_launch == []


def test_bad_ft_values_fail_fast(
    tmp_path: Path, no_launch: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    ft = ["--preset", "tiny", "--run-dir", str(tmp_path / "run"), "--ft-lighthouse", "h:1"]
    _fails([*ft, "--ft-replica-id", "2"], capsys, "--ft-replica-id 2", "--ft-replicas 2", "0 to 1")
    _fails([*ft, "--ft-replicas", "0"], capsys, "--ft-replicas", "positive")
    _fails(
        [*ft, "--dp-replicate", "2", "--nproc", "2"], capsys, "--ft-lighthouse", "--dp-replicate"
    )
    _fails(
        [*ft, "--ft-replicas", "3", "--nproc", "1"], capsys, "--ft-replicas x ranks", "3 x 2 = 6"
    )
    serve = ["--preset", "tiny", "--run-dir", str(tmp_path / "run"), "--ft-serve-lighthouse"]
    _fails(serve, capsys, "--ft-serve-lighthouse needs --ft-lighthouse HOST:PORT")
    _fails([*serve, "--ft-lighthouse", "nohost"], capsys, "'nohost' is not HOST:PORT")
    assert no_launch == []


def test_served_lighthouse_on_a_busy_port_names_it(
    tmp_path: Path, no_launch: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[ft]')")
    with socket.socket(socket.AF_INET6) as busy:
        busy.bind(("::", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["--preset", "tiny", "--run-dir", str(tmp_path / "run"), "--nproc", "1"]
        args += ["--ft-lighthouse", f"127.0.0.1:{port}", "--ft-serve-lighthouse"]
        _fails(args, capsys, f"--ft-serve-lighthouse could not serve port {port}", "free port")
    assert no_launch == []  # the launch never ran


def test_bad_flag_exits_before_spawning(tmp_path: Path) -> None:
    """Through the real console entry: fails in about the time of an import, creates nothing."""
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *"-m fullshard.cli train --preset tiny --max-steps -1".split()]
        + ["--run-dir", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--max-steps must be a positive integer, got -1" in proc.stderr
    assert not (tmp_path / "r").exists()
    assert time.monotonic() - t0 < 30


def _pythonpath() -> str:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    root = str(launch.package_root())
    return os.pathsep.join(paths if root in paths else [*paths, root])


# ---------------------------------------------------------------- data


def test_embedded_corpus_is_the_stdlib() -> None:
    files = data_mod.embedded_corpus_files()
    names = {p.name for p in files}
    assert {"os.py", "dataclasses.py"} <= names
    assert not any("test" in p.parts[-2:-1] for p in files)


def test_sampler_is_deterministic_and_resumes_mid_epoch() -> None:
    kw = {"seq_len": 8, "global_batch": 6, "seed": 3}
    a = data_mod.Sampler(200, **kw)
    batches = [a.next_batch() for _ in range(12)]  # 24 windows/epoch: crosses epochs
    b = data_mod.Sampler(200, **kw)
    for _ in range(5):
        b.next_batch()
    state = json.loads(json.dumps(b.state_dict()))
    c = data_mod.Sampler(200, **kw)
    c.load_state_dict(state)
    for expected in batches[5:]:
        np.testing.assert_array_equal(c.next_batch(), expected)
    epoch0 = np.concatenate(batches[:4])  # exactly one epoch: no window twice
    assert len(set(epoch0.tolist())) == len(epoch0)
    assert all(s + 9 <= 200 for s in np.concatenate(batches).tolist())


def test_rank_slices_tile_the_global_batch() -> None:
    for world in (1, 2, 4):
        rows = [list(range(8))[data_mod.rank_slice(8, r, world)] for r in range(world)]
        assert [i for row in rows for i in row] == list(range(8))


def test_bin_data_and_eval_split(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint16) % 300
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    loaded = data_mod.load_tokens(str(path), vocab_size=300)
    np.testing.assert_array_equal(loaded, tokens)
    split = data_mod.TokenData.split(loaded, 0.1, byte_level=False)
    assert len(split.train) == 900 and len(split.eval) == 100
    wide = data_mod.load_tokens(str(path), data_dtype="uint32")
    assert len(wide) == 500


# ---------------------------------------------------------------- metrics and progress


def test_metrics_log_cuts_back_to_the_resumed_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, resume_step=0)
    for s in range(1, 6):
        log.write("train", step=s, loss=1.0)
    log.close()
    with path.open("a") as f:
        f.write('{"kind": "train", "st')  # torn line from a kill
    log = MetricsLog(path, resume_step=3)
    log.write("train", step=4, loss=2.0)
    log.close()
    kept = [(r["step"], r["loss"]) for r in read_metrics(path)]
    assert kept == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0)]


def test_progress_bar_and_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    rec = {"step": 5, "loss": 1.5, "tokens_per_s": 1234.0, "peak_mem_mib": [10.0, 11.0]}
    out = io.StringIO()
    bar = Progress(total=10, start=0, mode="bar", log_every=5, out=out)
    bar.step(rec)
    bar.line("eval")
    bar.close()
    assert out.getvalue().startswith("\r") and "1.2k tok/s" in out.getvalue()
    assert "10/11 MiB" in out.getvalue() and "eta" in out.getvalue()
    out = io.StringIO()
    plain = Progress(total=10, start=0, mode="auto", log_every=5, out=out)  # StringIO: no TTY
    plain.step(rec)
    plain.step({**rec, "step": 6})
    assert out.getvalue().count("\n") == 1 and "\r" not in out.getvalue()
    monkeypatch.setenv("COLUMNS", "40")  # the bar never wraps: \r could not redraw it
    out = io.StringIO()
    Progress(total=10, start=0, mode="bar", log_every=5, out=out).step(rec)
    assert len(out.getvalue()) <= len("\r\x1b[2K") + 39


def test_hf_config_from_file_dir_or_inline(tmp_path: Path) -> None:
    from fullshard.train import hf

    raw = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert hf.parse_config(str(tmp_path)) == raw
    assert hf.parse_config(str(tmp_path / "config.json")) == raw
    assert hf.parse_config(json.dumps(raw)) == raw
    with pytest.raises(hf.HFError, match="--hf-config"):
        hf.parse_config(str(tmp_path / "missing.json"))


def test_bin_tokens_beyond_the_vocabulary_fail_fast(
    tmp_path: Path, no_launch: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tokens.bin"
    (np.arange(5000) % 1000).astype(np.uint16).tofile(path)
    args = ["--preset", "tiny", "--run-dir", str(tmp_path / "run"), "--data", str(path)]
    _fails(args, capsys, "token ids up to 999", "--vocab-size")
    assert no_launch == []


def test_a_run_dir_in_use_is_refused(
    tmp_path: Path, no_launch: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    """Two launches never share a run directory (two torchft groups given one --run-dir)."""
    from fullshard.train.launch import hold_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = ["--preset", "tiny", "--run-dir", str(run_dir), "--nproc", "1", "--max-steps", "1"]
    with hold_run_dir(run_dir):
        (run_dir / "config.toml").write_text("the other launch's")
        _fails(
            args, capsys, f"--run-dir {run_dir} is in use by fullshard train pid", "own --run-dir"
        )
        assert (run_dir / "config.toml").read_text() == "the other launch's"  # not overwritten
    assert no_launch == []
    assert cli.main(args) == 0 and len(no_launch) == 1  # free again once the holder is done
