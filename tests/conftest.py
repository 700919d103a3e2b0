"""Shared fixtures: tiny random models built in place, never downloaded."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Tiny models are fastest on one thread, and intra-op threads thrash when the two cores
# are shared with other work (measured: 13x slower per forward under load).
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (the full statistical grid)")


def pytest_collection_modifyitems(config, items):
    """Tests marked slow are skipped unless --slow is given (the README's test command and CI give it)."""
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow (the full statistical grid, compiled forwards): run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def tiny_llama(vocab_size: int = 128, hidden_size: int = 32, layers: int = 2, seed: int = 0, max_positions: int = 512) -> LlamaForCausalLM:
    """A fixed-seed random Llama (fp32, eval mode)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    # Larger logits than the default init, so greedy argmaxes are far from ties and
    # sampled distributions are peaked enough to make drafts worth testing.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="session")
def small_vocab_model() -> LlamaForCausalLM:
    """Vocabulary of 8, so exact joint distributions over a few tokens are cheap to enumerate."""
    return tiny_llama(vocab_size=8, hidden_size=16, seed=3)


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper chi-square quantile by the Wilson-Hilferty approximation (z = 3.09: alpha = 1e-3)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * a**0.5) ** 3


def chi_square_test(counts: dict, expected_probs: dict, n: int) -> tuple[float, float, float]:
    """Return (chi-square statistic, critical value at alpha=1e-3, total variation distance).

    Cells with expected count < 5 are pooled into one cell. A sampled outcome outside
    ``expected_probs`` (probability 0 under the law) makes the statistic infinite.
    """
    if any(k not in expected_probs or expected_probs[k] == 0 for k in counts):
        return float("inf"), 0.0, 1.0
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for k, p in expected_probs.items():
        if n * p < 5:
            pooled_obs += counts.get(k, 0)
            pooled_exp += n * p
        else:
            stat += (counts.get(k, 0) - n * p) ** 2 / (n * p)
            cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in expected_probs.items())
    return stat, chi_square_critical(max(cells - 1, 1)), tv


@pytest.fixture(scope="session")
def law_check():
    return chi_square_test


@pytest.fixture(scope="session")
def make_llama():
    return tiny_llama


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A saved tiny Llama + byte-level BPE tokenizer directory, loadable with the Auto classes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = ["the quick brown fox jumps over the lazy dog. " * 4, "def add(a, b):\n    return a + b\n" * 4]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<bos>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    model = tiny_llama(vocab_size=300)
    path = tmp_path_factory.mktemp("tiny_target")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
