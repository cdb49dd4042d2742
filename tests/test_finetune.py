"""Fine-tuning a local Hugging Face model: tokenized text/chat/parquet data with assistant-only
loss, 2 gloo ranks through the real CLI, resume mid-epoch, TensorBoard, and ``ckpt export --hf``
loaded back with ``from_pretrained``. One run (and one resumed rerun) serves every check.

The oracle for "the pipeline is right" is a single-process recomputation: the loss of the saved
pretrained model on the first global batch (rebuilt here from the cache, the sampler and the
mask) must equal step 1's logged loss, and the exported model's held-out loss must equal the
run's last eval loss.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch
import torch.nn.functional as F

import hf_local
from fullshard.train import data as data_mod
from fullshard.train.metrics import read_metrics
from fullshard.train.tokenized import cached_stream, encode_record, read_records

STEPS, CKPT_EVERY, SEQ = 8, 4, 64


def _env() -> dict[str, str]:
    from fullshard.train.launch import package_root

    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    pythonpath = os.pathsep.join([*paths, str(package_root())])
    return {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _fullshard(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "fullshard.cli", *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=cwd,
        timeout=300,
    )
    return proc


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ["HF_HUB_OFFLINE"] = "1"
    return hf_local.make_hf_model_dir(tmp_path_factory.mktemp("hf") / "model")


def _masked_loss(
    model: Any, tokens: np.ndarray, mask: np.ndarray | None, starts: np.ndarray
) -> float:
    inputs, targets = data_mod.gather_batch(tokens, mask, starts, SEQ)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    return float(loss) / int((targets != data_mod.IGNORE_INDEX).sum())


def test_chat_records_learn_only_assistant_tokens(hf_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    chat = {"messages": hf_local.conversation(random.Random(3))}
    ids, mask = encode_record(tok, chat)
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    reply = chat["messages"][1]["content"]
    assert learned == f"{reply}<|end|>"  # the reply and its end-of-turn, nothing else
    assert tok.decode([i for i, m in zip(ids, mask) if not m]).startswith("<|user|>add ")
    ids, mask = encode_record(tok, {"text": "one two"})
    assert ids[-1] == tok.eos_token_id and all(mask)

    # the same records as .jsonl, .parquet and (text only) .txt give the same documents
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    records = hf_local.write_chat_jsonl(tmp_path / "d.jsonl", 10)
    chats = [r for r in records if "messages" in r]
    pq.write_table(pa.table({"messages": [r["messages"] for r in chats]}), tmp_path / "d.parquet")
    assert list(read_records(tmp_path / "d.parquet")) == chats
    (tmp_path / "d.txt").write_text("just text")
    assert list(read_records(tmp_path / "d.txt")) == [{"text": "just text"}]
    with pytest.raises(data_mod.DataError, match="expected"):
        (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
        list(read_records(tmp_path / "bad.jsonl"))

    # tokenized once: the second call reads the cache (no tokenizer is loaded)
    first = cached_stream(str(tmp_path / "d.jsonl"), str(hf_dir), tmp_path / "cache")
    import fullshard.train.tokenized as tokenized

    def no_tokenizer(path: str) -> None:
        raise AssertionError("re-tokenized instead of reading the cache")

    original, tokenized.load_tokenizer = tokenized.load_tokenizer, no_tokenizer  # type: ignore[assignment]
    try:
        again = cached_stream(str(tmp_path / "d.jsonl"), str(hf_dir), tmp_path / "cache")
    finally:
        tokenized.load_tokenizer = original
    assert np.array_equal(first[0], again[0]) and first[1] is not None
    assert np.array_equal(first[1], again[1])  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def finetuned(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Fine-tune 8 steps on 2 ranks (meta init: each rank reads only its rows of the weights);
    then drop the last checkpoint and rerun with the default init (resuming at step 4)."""
    root = tmp_path_factory.mktemp("ft")
    hf_local.write_chat_jsonl(root / "chat.jsonl", 400)
    args = ["train", "--preset", "tiny", "--hf-model", str(hf_dir), "--data", "chat.jsonl"]
    args += ["--max-steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--eval-every", "4"]
    args += ["--seq-len", str(SEQ), "--sample-tokens", "5", "--tensorboard", "--run-dir", "run"]
    first = _fullshard(*args, "--init", "meta", cwd=root)  # weights read shard by shard
    assert first.returncode == 0, first.stdout + first.stderr
    run = root / "run"
    losses = {
        r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"
    }
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:08d}")
    second = _fullshard(*args, cwd=root)
    assert second.returncode == 0, second.stdout + second.stderr
    return {"root": root, "run": run, "first_losses": losses, "stdout": second.stdout}


def test_finetune_starts_from_the_pretrained_weights_and_learns(
    finetuned: dict[str, Any], hf_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    run = finetuned["run"]
    losses = finetuned["first_losses"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.5
    # step 1 = the saved model's masked loss on the first global batch, recomputed here
    tokens, mask, _ = cached_stream(str(finetuned["root"] / "chat.jsonl"), str(hf_dir), None)
    assert mask is not None and 0.05 < mask.mean() < 0.9  # chat prompts are not learned
    split = data_mod.TokenData.split(tokens, 0.02, byte_level=False, mask=mask)
    sampler = data_mod.Sampler(len(split.train), seq_len=SEQ, global_batch=8, seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True)
    expected = _masked_loss(model, split.train, split.train_mask, sampler.next_batch())
    assert losses[1] == pytest.approx(expected, rel=1e-5)
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    assert len(list((run / "data_cache").glob("*.tokens.npy"))) == 1  # tokenized once


def test_hf_model_weights_load_when_built_whole(hf_dir: Path) -> None:
    """--init cpu (the default below 1B parameters) loads --hf-model's weights before sharding."""
    from transformers import AutoModelForCausalLM

    from fullshard.train.config import TrainConfig
    from fullshard.train.models import build_model

    built = build_model(TrainConfig(preset="tiny", hf_model=str(hf_dir))).state_dict()
    saved = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).state_dict()
    assert built.keys() == saved.keys()
    assert all(torch.equal(built[k], saved[k]) for k in saved)


def test_finetune_resumes_mid_epoch_exactly(finetuned: dict[str, Any], hf_dir: Path) -> None:
    from fullshard.checkpoint import CheckpointReader

    run = finetuned["run"]
    assert f"resumed from {run.name}/checkpoints/step_{CKPT_EVERY:08d}" in finetuned["stdout"]
    extra = CheckpointReader(run / "checkpoints" / f"step_{CKPT_EVERY:08d}").manifest.extra
    assert extra["sampler"] == {"epoch": 0, "offset": CKPT_EVERY * 8}  # mid-epoch
    # the data position is the checkpoint's: a sampler restored from it yields the batch a
    # sampler that never stopped yields next
    tokens, _, _ = cached_stream(str(finetuned["root"] / "chat.jsonl"), str(hf_dir), None)
    n_train = len(tokens) - int(len(tokens) * 0.02)
    straight = data_mod.Sampler(n_train, seq_len=SEQ, global_batch=8, seed=0)
    for _ in range(CKPT_EVERY):
        straight.next_batch()
    restored = data_mod.Sampler(n_train, seq_len=SEQ, global_batch=8, seed=0)
    restored.load_state_dict(extra["sampler"])
    assert np.array_equal(restored.next_batch(), straight.next_batch())
    # and the resumed steps repeat the uninterrupted ones exactly
    losses = {
        r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"
    }
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in range(CKPT_EVERY + 1, STEPS + 1):
        assert losses[step] == pytest.approx(finetuned["first_losses"][step], rel=1e-6), step


def test_tensorboard_events_match_metrics(finetuned: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = finetuned["run"]
    acc = EventAccumulator(str(run))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("train/loss")}
    metrics = [r for r in read_metrics(run / "metrics.jsonl")]
    train = {r["step"]: r["loss"] for r in metrics if r["kind"] == "train"}
    assert sorted(tb) == sorted(train)  # the rerun's steps replaced the stale ones
    for step, loss in train.items():
        assert tb[step] == pytest.approx(loss, rel=1e-6)
    evals = {e.step: e.value for e in acc.Scalars("eval/loss")}
    assert evals[STEPS] == pytest.approx([r for r in metrics if r["kind"] == "eval"][-1]["loss"])
    assert {"train/lr", "train/grad_norm", "train/peak_mem_mib"} <= set(acc.Tags()["scalars"])


def test_tensorboard_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from fullshard.train import checks
    from fullshard.train.config import ConfigError, TrainConfig

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    cfg = TrainConfig(preset="tiny", tensorboard=True, run_dir="unused")
    with pytest.raises(ConfigError, match=r"pip install 'fullshard\[tensorboard\]'"):
        checks.validate(cfg, world_size=2)


def _files(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (``None`` for a directory)."""
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def test_checks_write_nothing_and_the_run_caches_the_tokens(
    hf_dir: Path, tmp_path: Path, no_launch: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    """A command the pre-launch checks refuse -- here, after tokenizing --data, because the
    run directory holds another model's checkpoint -- leaves that directory byte for byte as
    it was; a command they accept has its tokens cached before the launch."""
    from fullshard import cli
    from fullshard.train import checks
    from fullshard.train.cli import parse_config
    from fullshard.train.config import to_toml
    from reliability_helpers import save_train_checkpoint

    hf_local.write_chat_jsonl(tmp_path / "chat.jsonl", 400)
    run_dir = tmp_path / "gpt-run"
    save_train_checkpoint(run_dir / "checkpoints" / "step_00000010", step=10)
    (run_dir / "config.toml").write_text(to_toml(parse_config(["--run-dir", str(run_dir)])))
    before = _files(run_dir)
    args = ["train", "--preset", "tiny", "--hf-model", str(hf_dir)]
    args += ["--seq-len", str(SEQ), "--data", str(tmp_path / "chat.jsonl")]
    assert cli.main([*args, "--run-dir", str(run_dir)]) == 2
    assert "holds checkpoints of another model" in capsys.readouterr().err
    assert _files(run_dir) == before and no_launch == []

    fresh = tmp_path / "runs" / "llama"
    checked = checks.validate(parse_config([*args[1:], "--run-dir", str(fresh)]), world_size=2)
    assert checked.data_cache is not None and not fresh.parent.exists()  # probed, not created
    assert cli.main([*args, "--run-dir", str(fresh)]) == 0 and len(no_launch) == 1
    assert sorted(p.name for p in (fresh / "data_cache").iterdir())[-1].endswith(".tokens.npy")
    assert {"config.toml", "checkpoints", "data_cache"} == {p.name for p in fresh.iterdir()}


def test_export_hf_loads_with_from_pretrained(
    finetuned: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fullshard.checkpoint.cli import main as ckpt_main
    from fullshard.train.models import load_exported

    root, run = finetuned["root"], finetuned["run"]
    out = root / "exported"
    assert ckpt_main(["export", str(run), "--hf", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tok.chat_template == hf_local.CHAT_TEMPLATE
    # identical to the trained (sharded) model: its held-out loss is the run's last eval loss
    tokens, mask, _ = cached_stream(str(root / "chat.jsonl"), str(out), None)
    split = data_mod.TokenData.split(tokens, 0.02, byte_level=False, mask=mask)
    starts = data_mod.eval_starts(len(split.eval), seq_len=SEQ, count=2 * 8)
    last_eval = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval"][-1]
    assert last_eval["step"] == STEPS
    assert _masked_loss(model, split.eval, split.eval_mask, starts) == pytest.approx(
        last_eval["loss"], rel=1e-5
    )
    x = torch.tensor([tok("add one and two")["input_ids"]])
    assert torch.equal(load_exported(out)(input_ids=x).logits, model(input_ids=x).logits)
    # an existing output is refused, and replaced with --force
    capsys.readouterr()
    assert ckpt_main(["export", str(run), "--hf", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert ckpt_main(["export", str(run), "--hf", str(out), "--force", "--dtype", "bf16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16" != config["dtype"]
