"""Medusa heads: the module (K residual blocks and LM heads), its checkpoints and its calibration.

Checkpoints: the native layout is vLLM's (``config.json`` with ``model_type: medusa``;
``blocks.{h}.layers.{l}.weight/bias``, ``lm_heads.{h}.weight``). FasterDecoding's original
layout loads too (``{h}.{l}.linear.weight/bias``, ``{h}.{L}.weight``, ``medusa_num_heads`` /
``medusa_num_layers``). ``calibration.json``, written when the heads are trained here, holds
how often each path of guesses was right on held-out text, from which the proposer grows
its tree (``proposers.medusa``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .core.checkpoint import CONFIG, WEIGHTS, check_fits_target, check_tensors, read_checkpoint
from .core.errors import InputError, check_integer
from .core.static_tree import grow_tree_by_accuracy, grow_tree_by_frequency

CALIBRATION = "calibration.json"
ORIGINAL_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # FasterDecoding's file names
DEFAULT_MAX_NODES = 16  # a calibrated tree's budget: T(17)/T(1) is about 1.3 for the demo target on a CPU core


class ResidualBlock(nn.Module):
    """``x + SiLU(W x + b)``, ``num_layers`` times; the weights start at zero, so a fresh block is the identity."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        self.act = nn.SiLU()
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            if bias:
                nn.init.zeros_(layer.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = hidden + self.act(layer(hidden))
        return hidden


class MedusaHeads(nn.Module):
    """K Medusa heads: a residual block and an LM head each (vLLM's module names).

    Args:
        hidden_size: the target's hidden size.
        vocab_size: the target's output vocabulary.
        num_heads: K; head k guesses the token k + 1 places after the position it reads.
        num_layers: residual layers per head.
        bias: whether the residual layers have biases (FasterDecoding's do; vLLM reads
            ``medusa_fc_bias`` from the config).
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1, bias: bool = True):
        super().__init__()
        for name, value, least in (("hidden_size", hidden_size, 1), ("vocab_size", vocab_size, 1), ("num_heads", num_heads, 1)):
            if check_integer(name, value) < least:
                raise InputError(f"{name} must be >= {least}, got {value}")
        if check_integer("num_layers", num_layers) < 0:
            raise InputError(f"num_layers must be >= 0, got {num_layers}")
        self.hidden_size, self.vocab_size, self.num_heads, self.num_layers, self.bias = hidden_size, vocab_size, num_heads, num_layers, bias
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers, bias) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))

    @classmethod
    def for_target(cls, target: nn.Module, num_heads: int, num_layers: int = 1, bias: bool = True) -> MedusaHeads:
        """Fresh heads for ``target``: identity blocks, LM heads copied from the target's (as the paper starts them)."""
        head = target.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            raise InputError("Medusa heads copy the target's LM head: it needs a bias-free output embedding (a Linear)")
        vocab, hidden = head.weight.shape
        heads = cls(int(hidden), int(vocab), num_heads, num_layers, bias)
        with torch.no_grad():
            for lm_head in heads.lm_heads:
                lm_head.weight.copy_(head.weight.float())
        return heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of every head ``[num_heads, ..., vocab]`` from final hidden states ``[..., hidden]``."""
        return torch.stack([lm_head(block(hidden)) for block, lm_head in zip(self.blocks, self.lm_heads, strict=True)])

    def config(self) -> dict:
        """``config.json``: the fields vLLM's ``MedusaConfig`` reads, with the residual bias flag."""
        return {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_heads": self.num_heads,
            "num_hidden_layers": self.num_layers,
            "medusa_fc_bias": self.bias,
        }

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        """Write ``config.json`` and ``model.safetensors`` (vLLM's layout) into ``out_dir``."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().to(dtype).contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
        (out_dir / "config.json").write_text(json.dumps(self.config(), indent=1) + "\n")


# -- loading ----------------------------------------------------------------------------


def load_heads(path: str | Path) -> MedusaHeads:
    """Load Medusa heads from a directory in vLLM's layout (native) or FasterDecoding's.

    A missing or unreadable file, a config without head counts, or weights that miss a
    head or have the wrong shape is one InputError line naming the file.
    """
    checkpoint = read_checkpoint(path, "Medusa heads", (WEIGHTS, *ORIGINAL_WEIGHTS))
    config, config_file, weights_file, tensors = checkpoint.config, checkpoint.path / CONFIG, checkpoint.weights, checkpoint.tensors
    original = any(name.split(".")[0].isdigit() for name in tensors)
    tensors = _from_original(tensors) if original else {k.removeprefix("medusa_heads."): v for k, v in tensors.items()}
    num_heads = _config_int(config, config_file, "num_heads", "medusa_num_heads")
    num_layers = _config_int(config, config_file, "num_hidden_layers", "medusa_num_layers")
    head0 = tensors.get("lm_heads.0.weight")
    if head0 is None or head0.dim() != 2:
        raise InputError(f"Medusa weights {weights_file} have no LM head for head 0 (lm_heads.0.weight)")
    vocab, hidden = head0.shape
    bias = any(k.endswith(".bias") for k in tensors) if original else bool(config.get("medusa_fc_bias", False))
    heads = MedusaHeads(int(hidden), int(vocab), num_heads, num_layers, bias)
    expected = heads.state_dict()
    missing = [k for k in expected if k not in tensors]
    if missing:
        present = sorted({int(k.split(".")[1]) for k in tensors if k.startswith(("blocks.", "lm_heads."))})
        raise InputError(
            f"Medusa weights {weights_file} miss {len(missing)} tensor(s) of the {num_heads} heads {config_file.name} announces "
            f"(first: {missing[0]}; heads with weights: {present})"
        )
    check_tensors(weights_file, tensors, expected, "Medusa")
    heads.load_state_dict({k: v.float() for k, v in tensors.items()})
    return heads.eval()


def _from_original(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FasterDecoding's names -> vLLM's.

    ``{h}.{l}.linear.*`` -> ``blocks.{h}.layers.{l}.*`` and ``{h}.{L}.weight`` -> ``lm_heads.{h}.weight``.
    """
    renamed = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[2] == "linear":
            renamed[f"blocks.{parts[0]}.layers.{parts[1]}.{parts[3]}"] = tensor
        elif len(parts) == 3 and parts[2] == "weight":
            renamed[f"lm_heads.{parts[0]}.weight"] = tensor
        else:
            renamed[name] = tensor  # reported as unexpected
    return renamed


def _config_int(config: dict, config_file: Path, *names: str) -> int:
    for name in names:
        if name in config:
            value = config[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if "layers" in name else 1):
                raise InputError(f"Medusa config {config_file}: {name} must be a whole number, got {value!r}")
            return value
    raise InputError(f"Medusa config {config_file} states none of {list(names)}")


def check_heads_fit(heads: MedusaHeads, target: nn.Module) -> None:
    """Raise InputError unless ``heads`` read the target's hidden size and score its vocabulary."""
    check_fits_target("Medusa heads", target, hidden_size=heads.hidden_size, vocab_size=heads.vocab_size)


# -- calibration --------------------------------------------------------------------------


def grow_calibrated_tree(calibration: dict, max_nodes: int, num_heads: int) -> list[tuple[int, ...]]:
    """The best tree for the budget: by the measured frequency of every rank path if known, else by per-head accuracies."""
    counts = calibration.get("path_counts")
    if counts:
        return grow_tree_by_frequency({p: c for p, c in parse_path_counts(counts).items() if len(p) <= num_heads}, max_nodes)
    return grow_tree_by_accuracy(calibration["rank_accuracy"][:num_heads], max_nodes)


def parse_path_counts(counts: dict) -> dict[tuple[int, ...], int]:
    """``{"0,1": n, ...}`` (JSON keys) -> ``{(0, 1): n, ...}``."""
    return {tuple(int(r) for r in key.split(",")): int(n) for key, n in counts.items()}


def read_calibration(path: Path) -> dict | None:
    """The heads' ``calibration.json`` (top-i accuracy per head and rank-path frequencies on held-out text), or None when there is none."""
    file = path / CALIBRATION
    if not file.is_file():
        return None
    try:
        calibration = json.loads(file.read_text(encoding="utf-8"))
        accuracy = calibration["rank_accuracy"]
        if not accuracy or not all(
            isinstance(row, list) and all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in row) for row in accuracy
        ):
            raise ValueError("rank_accuracy must be a non-empty list of lists of accuracies in [0, 1]")
        counts = parse_path_counts(calibration.get("path_counts") or {})
        if any(not p or min(p) < 0 or n < 0 for p, n in counts.items()):
            raise ValueError("path_counts must map comma-separated ranks >= 0 to counts >= 0")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise InputError(f"Medusa calibration {file} cannot be used: {error}") from error
    return calibration


def write_calibration(
    out_dir: Path,
    rank_accuracy: list[list[float]],
    tokens: int,
    max_nodes: int = DEFAULT_MAX_NODES,
    path_counts: dict[tuple[int, ...], int] | None = None,
) -> None:
    """Write ``calibration.json``: per-head accuracy per rank, every rank path's frequency (if measured), the tree grown from them."""
    calibration = {"rank_accuracy": rank_accuracy, "tokens": tokens, "max_nodes": max_nodes}
    if path_counts:
        calibration["path_counts"] = {
            ",".join(map(str, p)): n for p, n in sorted(path_counts.items(), key=lambda item: (len(item[0]), item[0]))
        }
    calibration["tree"] = [list(p) for p in grow_calibrated_tree(calibration, max_nodes, len(rank_accuracy))]
    (out_dir / CALIBRATION).write_text(json.dumps(calibration, indent=1) + "\n")
