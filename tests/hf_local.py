"""Local Hugging Face fixtures for fine-tuning tests: a BPE tokenizer trained in a second with
the ``tokenizers`` package, a tiny Llama saved with ``save_pretrained``, and chat/text data.
Nothing is downloaded (the tests set ``HF_HUB_OFFLINE``)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def conversation(rng: random.Random) -> list[dict[str, str]]:
    """One user/assistant exchange: 'add a and b' -> the sum, spelled (learnable quickly)."""
    a, b = rng.randrange(6), rng.randrange(6)
    return [
        {"role": "user", "content": f"add {WORDS[a]} and {WORDS[b]}"},
        {"role": "assistant", "content": f"that is {WORDS[a + b]}"},
    ]


def write_chat_jsonl(path: Path, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` records, every fifth a plain ``text`` record, the rest chat ``messages``."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    for i in range(n):
        if i % 5 == 4:
            records.append({"text": " ".join(rng.choice(WORDS) for _ in range(12))})
        else:
            records.append({"messages": conversation(rng)})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def make_tokenizer(out: Path) -> Any:
    """Train a byte-level BPE on the task's words and save it as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(1)
    corpus = [
        f"add {a} and {b} that is {c}" for a, b, c in (rng.sample(WORDS, 3) for _ in range(300))
    ]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|eos|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def tiny_llama(
    vocab_size: int,
    *,
    width: tuple[int, int] = (32, 48),
    max_positions: int = 64,
    tie: bool = False,
    seed: int = 0,
) -> Any:
    """A 2-layer Llama (``width``: hidden and MLP sizes, 4 heads, 2 KV heads) with random
    weights from ``seed``: no download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=width[0],
        intermediate_size=width[1],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg)


def make_llama(out: Path, vocab_size: int, seed: int = 0, max_positions: int = 128) -> Any:
    """A 2-layer, 64-wide Llama with random weights, saved (safetensors) with its config."""
    model = tiny_llama(vocab_size, width=(64, 128), max_positions=max_positions, seed=seed)
    model.save_pretrained(str(out))
    return model


def make_hf_model_dir(out: Path, max_positions: int = 128) -> Path:
    """A local HF model directory: config, safetensors weights and tokenizer files."""
    tok = make_tokenizer(out)
    make_llama(out, vocab_size=len(tok), max_positions=max_positions)
    return out
