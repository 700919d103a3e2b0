"""Fixtures of the training tests: a tiny saved target with the project's chat tokenizer, and a text file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.training.demo.tokenizer import build_tokenizer

from tiny_recipe import TEXT


def save_tiny_target(path: Path, layers: int = 2) -> Path:
    """A tiny random Llama (peaked logits) with the project's chat-template tokenizer, saved to ``path``."""
    tokenizer = build_tokenizer([TEXT] * 4, vocab_size=300, model_max_length=64, out_dir=path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # a peaked target: there is something to learn
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def deep_target_dir(tmp_path_factory) -> Path:
    """Four layers: enough for EAGLE-3's three aux layers."""
    return save_tiny_target(tmp_path_factory.mktemp("deep_target"), layers=4)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text(TEXT)
    return path
