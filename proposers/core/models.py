"""Loading and checking Hugging Face causal LMs: the target's and every draft's.

Loading goes through ``from_pretrained`` on a local directory (no hub); a broken
``config.json``, weights or tokenizer file is one ``InputError`` line naming the file.
The checks say what a model's config allows (its positions) and whether its cache can be
rolled back (full attention only).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

from .errors import InputError
from .files import read_json_object

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
POSITION_KEYS = ("max_position_embeddings", "n_positions")  # where configs state their positions (GPT-2: n_positions)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
#: What transformers, safetensors and json raise for a directory whose files cannot be read.
LOAD_ERRORS = (OSError, ValueError, KeyError, SafetensorError)


def load_causal_lm(path: Path, role: str, **kwargs) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` in eval mode; unreadable files are one InputError line.

    Args:
        role: what the model is, for messages (``"target"``, ``"draft"``).
    """
    config_file = path / "config.json"
    try:
        values = read_json_object(config_file, f"{role} config")
    except FileNotFoundError:
        raise InputError(f"{role} directory {path} has no config.json (expected a save_pretrained model directory)") from None
    if not isinstance(values.get("model_type"), str):
        raise InputError(f"{role} config {config_file} has no model_type (a save_pretrained config.json names its architecture)")
    try:
        config = AutoConfig.from_pretrained(path)
    except LOAD_ERRORS as error:
        raise InputError(f"{role} config {config_file} cannot be used: {_first_line(error)}") from error
    weights = next((path / name for name in WEIGHT_FILES if (path / name).is_file()), path)
    try:
        return AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs).eval()
    except LOAD_ERRORS as error:
        hint = " (a truncated or corrupt file)" if isinstance(error, SafetensorError) else ""
        raise InputError(f"{role} weights {weights} cannot be loaded{hint}: {_first_line(error)}") from error


def load_tokenizer(path: Path, role: str):
    """``AutoTokenizer.from_pretrained(path)``; a tokenizer file that cannot be read is one InputError line naming it."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # tokenizers' parsers raise bare Exception, KeyError, ValueError, OSError
        raise InputError(f"{role} tokenizer {_broken_tokenizer_file(path)} cannot be loaded: {_first_line(error)}") from error


def _broken_tokenizer_file(path: Path) -> str:
    """The tokenizer JSON file in ``path`` that does not parse, else the tokenizer files present (for messages)."""
    files = [name for name in TOKENIZER_FILES if (path / name).is_file()]
    for name in files:
        if name.endswith(".json"):
            try:
                json.loads((path / name).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return str(path / name)
    if "tokenizer.json" in files:
        try:
            Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception:  # valid JSON, but not a tokenizer
            return str(path / "tokenizer.json")
    return str(path / files[0]) if len(files) == 1 else f"{path} ({', '.join(files)})"


def _first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, cut to ``limit`` characters (transformers' messages run long)."""
    if isinstance(error, KeyError):  # its message is the bare key
        return f"missing key {error}"
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def output_vocab_size(model: torch.nn.Module) -> int:
    """Rows of a causal LM's output embedding: the token ids its logits range over."""
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


def default_mask_token(model: torch.nn.Module) -> int:
    """The token a parallel drafter's mask positions stand for by default: the pad token, else the last id."""
    pad = getattr(model.config, "pad_token_id", None)
    vocab = output_vocab_size(model)
    return pad if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < vocab else vocab - 1


def saved_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes: the state dict without the second name of a tied tensor."""
    kept = set(dict(model.named_parameters(remove_duplicate=True))) | set(dict(model.named_buffers()))
    tied = set(model.state_dict()) - kept
    return {name: tensor.detach().cpu() for name, tensor in model.state_dict().items() if name not in tied}


def context_limit(model: nn.Module) -> int | None:
    """The positions a causal LM's config allows (``max_position_embeddings``, or GPT-2's ``n_positions``); None when it states none."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for key in POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_full_attention(model: nn.Module, role: str) -> None:
    """Raise InputError unless every layer of ``model``'s ``DynamicCache`` is a full-attention ``DynamicLayer``.

    Dropping rejected tokens slices each layer's keys and values (``crop_cache``,
    ``compact_cache``). A sliding-window layer has already evicted its oldest entries to
    make room for the guesses, so no slice brings them back, and its cumulative length
    would go stale; other layer types (linear attention, static) keep state a slice misses.
    """
    kinds = sorted({type(layer).__name__ for layer in DynamicCache(config=model.config).layers if type(layer) is not DynamicLayer})
    if kinds:
        name = type(model).__name__ + (f" ({model.name_or_path})" if getattr(model, "name_or_path", "") else "")
        window = getattr(model.config, "sliding_window", None)
        raise InputError(
            f"{role} model {name} has {', '.join(kinds)} cache layers"
            + (f" (sliding_window={window})" if window is not None else "")
            + ": only full-attention models are supported (rejected draft tokens cannot be cut out of such a cache)"
        )


@contextlib.contextmanager
def torch_threads(threads: int):
    """Run the block with ``threads`` torch CPU threads (0 keeps the current setting), restoring the caller's afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


SMALL_MODEL_PARAMETERS = 50_000_000  # below this, a decode step is overhead-bound: a second intra-op thread only synchronises


def decode_threads(model: nn.Module, threads: int | None = None) -> int:
    """The torch intra-op threads to decode ``model`` with: ``threads`` given, else 1 for a small model, torch's default for a large one.

    A small model's step is a few ms of many small ops: measured on the 2M-parameter demo
    target, one thread decodes as fast as two on an idle 2-core machine and 6x faster on a
    loaded one (two threads wait on each other whenever anything else runs). A large model's
    matrix products are worth splitting.
    """
    if threads is not None:
        return threads
    return 1 if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMETERS else torch.get_num_threads()
