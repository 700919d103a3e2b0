"""The DFlash block drafter: its shape, its layers, its checkpoints (``proposers.dflash`` drafts with it).

DFlash (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding"): a few
Qwen3-style decoder layers fill a block of ``block_size`` positions in one non-causal
forward. The block is the anchor (the last committed token, whose own target feature is
not known yet) followed by ``block_size - 1`` mask tokens; every block position attends to
the whole block and to the target's context. The context is the target's hidden states of
several layers (``aux_layers``, ``output_hidden_states`` ids) at every position before the
anchor, fused by ``fc`` and ``hidden_norm`` and projected to keys and values by each layer's
own ``k_proj`` / ``v_proj`` (with its ``k_norm`` and rotary position), never queried. The
block's mask positions 1 .. B - 1 guess the tokens 1 .. B - 1 after the anchor through the
final norm and the target's own LM head. Embedding and LM head are the target's, frozen and
never saved; the mask positions read a learned ``mask_embedding`` (started from the
target's embedding of ``mask_token_id``).

Both the proposer (one block per step, the context keys cached and extended by the
positions each verification commits) and the objective (``training.dflash``: every
sampled anchor's block at once, over the whole sequence's context) run ``DFlashLayer``,
so drafting computes what training fitted (``tests/proposers/test_dflash.py`` holds them equal).

The checkpoint is the layout vLLM's ``DFlashDraftModel`` loads (``layers.{i}.*``, ``fc``,
``hidden_norm``, ``norm``; ``dflash_config`` with ``block_size``, ``mask_token_id`` and
``target_layer_ids``, which count decoder layers from 0: id ``i`` here is layer ``i - 1``'s
output there), plus ``mask_embedding.pt``, the separately trained mask embedding vLLM
substitutes for ``mask_token_id``'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from .core.cache import PreallocatedLayer
from .core.checkpoint import CONFIG, READ_ERRORS, WEIGHTS, check_fits_target, check_tensors, read_checkpoint, read_shape
from .core.draft_layers import MLP, Attention, RMSNorm, RotaryTable, layer_shape, linear
from .core.errors import InputError, check_integer
from .core.models import default_mask_token, output_vocab_size

MASK_EMBEDDING = "mask_embedding.pt"  # vLLM's file for a mask embedding trained apart from the vocabulary's


@dataclass(frozen=True)
class DFlashConfig:
    """The shape of a DFlash drafter (stored in ``config.json`` under ``draftsmith_dflash``).

    Args:
        hidden_size: the drafter's width: the target's hidden size (it shares embedding and LM head).
        target_hidden_size: the width of each target feature.
        target_num_layers: the target's decoder layers (aux ids are checked against it).
        aux_layers: the target layers read (``output_hidden_states`` ids, ascending, in ``[1, N - 1]``).
        vocab_size: the target's vocabulary.
        block_size: positions per block: the anchor and ``block_size - 1`` guesses.
        mask_token_id: the token id the mask positions stand for (engines embed it; here the learned mask embedding).
        num_layers: the drafter's decoder layers.
        num_heads, num_kv_heads, head_dim, intermediate_size: each layer's attention and MLP.
        rms_norm_eps, rope_theta: as the target's.
    """

    hidden_size: int
    target_hidden_size: int
    target_num_layers: int
    aux_layers: list[int]
    vocab_size: int
    block_size: int
    mask_token_id: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self):
        check_dflash_layers(self.aux_layers, self.target_num_layers)
        if check_integer("block_size", self.block_size) < 2:
            raise InputError(f"block_size must be >= 2 (the anchor and at least one guess), got {self.block_size}")
        if check_integer("num_layers", self.num_layers) < 1:
            raise InputError(f"num_layers must be >= 1, got {self.num_layers}")
        if not 0 <= check_integer("mask_token_id", self.mask_token_id) < self.vocab_size:
            raise InputError(f"mask_token_id must be a token id in [0, {self.vocab_size}), got {self.mask_token_id}")
        if self.num_heads % self.num_kv_heads:
            raise InputError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


def check_dflash_layers(aux_layers, num_layers: int) -> None:
    """Raise InputError unless ``aux_layers`` are ascending, distinct ids of layer outputs in ``[1, num_layers - 1]``."""
    ids = list(aux_layers) if isinstance(aux_layers, (list, tuple)) else aux_layers
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InputError(f"aux_layers must be a non-empty list of layer ids, got {aux_layers!r}")
    if not all(1 <= i < num_layers for i in ids) or sorted(set(ids)) != ids:
        raise InputError(
            f"aux_layers {ids} must be ascending ids of layer outputs in [1, {num_layers - 1}] "
            f"(output_hidden_states numbering; the target has {num_layers} layers, and an engine hands a draft no later one)"
        )


def default_dflash_layers(num_layers: int, count: int = 4) -> list[int]:
    """``count`` target layers spread from the first layer's output to the last one an engine can hand over (``N - 1``)."""
    if num_layers < 2:
        raise InputError(f"a target of {num_layers} layer has no layer output before the last for DFlash to read")
    count = min(count, num_layers - 1)
    if count == 1:
        return [num_layers - 1]
    return sorted({round(1 + i * (num_layers - 2) / (count - 1)) for i in range(count)})


# -- the layers --------------------------------------------------------------------------


class DFlashLayer(nn.Module):
    """A Qwen3-style layer whose queries are the block's and whose keys and values are the context's, then the block's."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        hidden = cfg.hidden_size
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.self_attn = Attention(hidden, hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qk_norm_eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = MLP(hidden, cfg.intermediate_size)

    def context_kv(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, kv_heads, rows, d]`` of fused context rows ``[batch, rows, hidden]`` (already normed)."""
        return self.self_attn.kv(context, cos, sin)

    def forward(
        self,
        hidden: torch.Tensor,  # [batch, m, hidden] the block rows
        cos: torch.Tensor,  # [m, head_dim]
        sin: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor] | PreallocatedLayer,
        mask: torch.Tensor | None,  # bool [m, c + m] (True: may attend) or None: every row sees everything
    ) -> torch.Tensor:
        """The block rows after this layer.

        ``context`` is the context's keys and values ``[batch, kv_heads, c, d]`` (training), or
        the cache holding them (drafting): the block's keys are then written after them in
        place, and the caller truncates the cache back.
        """
        attn = self.self_attn
        q, k, v = attn.qkv(self.input_layernorm(hidden), cos, sin)
        if isinstance(context, PreallocatedLayer):
            keys, values = context.update(k, v)
        else:
            keys, values = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        attended = F.scaled_dot_product_attention(q, attn.expand_kv(keys), attn.expand_kv(values), attn_mask=mask)
        hidden = hidden + attn.out(attended)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraft(nn.Module):
    """A DFlash drafter: ``fc``, ``hidden_norm``, ``num_layers`` ``DFlashLayer``s, ``norm`` and the mask embedding.

    Args:
        cfg: its shape.
        embed_weight: the target's input embedding ``[vocab, hidden]`` (shared, not a parameter).
        lm_head_weight: the target's LM head ``[vocab, hidden]`` (shared, not a parameter).
    """

    def __init__(self, cfg: DFlashConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(embed_weight[cfg.mask_token_id].detach().clone().float())
        self.shared = {"embed": embed_weight.detach(), "lm_head": lm_head_weight.detach()}
        self._rotary = RotaryTable(cfg.head_dim, cfg.rope_theta)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The aux features side by side ``[..., n_aux * target_hidden]`` -> fused context rows ``[..., hidden]``."""
        return self.hidden_norm(linear(self.fc, features.to(self.fc.weight.dtype)))

    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:
        """``[batch, n]`` anchor tokens -> ``[batch, n * block_size, hidden]``: each anchor's embedding, then the mask embedding."""
        batch, n = anchors.shape
        first = F.embedding(anchors, self.shared["embed"]).to(self.mask_embedding.dtype)[:, :, None]  # [batch, n, 1, hidden]
        masks = self.mask_embedding.expand(batch, n, self.cfg.block_size - 1, -1)
        return torch.cat([first, masks], dim=2).reshape(batch, n * self.cfg.block_size, -1)

    def rotary(self, positions: torch.Tensor | range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin ``[m, head_dim]`` of ``positions`` ``[m]`` (``RotaryTable``: a range or list saves a read)."""
        return self._rotary(positions, self.fc.weight.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., vocab]`` of layer outputs: the final norm, then the target's LM head."""
        head = self.shared["lm_head"]  # the target's, in its dtype: a half-precision head is not copied to fp32 per call
        return F.linear(self.norm(hidden).to(head.dtype), head)

    # -- saving ----------------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """The drafter's tensors under the names vLLM's ``DFlashDraftModel`` loads (the mask embedding goes in its own file)."""
        return {name: tensor for name, tensor in self.state_dict().items() if name != "mask_embedding"}

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        """Write ``config.json``, ``model.safetensors`` and ``mask_embedding.pt`` (no embedding, no LM head) into ``out_dir``."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(dtype).contiguous() for k, v in self.tensors().items()}, str(out_dir / WEIGHTS), metadata={"format": "pt"})
        mask = {"mask_token_id": self.cfg.mask_token_id, "embedding": self.mask_embedding.detach().to(dtype).cpu().clone()}
        torch.save(mask, out_dir / MASK_EMBEDDING)
        (out_dir / CONFIG).write_text(json.dumps(checkpoint_config(self.cfg), indent=1) + "\n")


def checkpoint_config(cfg: DFlashConfig) -> dict:
    """``config.json``: the Qwen3 fields and ``dflash_config`` vLLM reads, and draftsmith's own copy of the shape."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "num_target_layers": cfg.target_num_layers,
        "dflash_config": {
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": [layer - 1 for layer in cfg.aux_layers],
        },
        "draftsmith_dflash": asdict(cfg),
    }


def read_dflash_config(path: str | Path) -> DFlashConfig:
    """The shape of the drafter saved in ``path``; a missing directory or a bad config is one clear error."""
    return read_shape(path, "draftsmith_dflash", DFlashConfig, "DFlash drafter")


def load_dflash(path: str | Path, target: nn.Module) -> DFlashDraft:
    """Load a drafter written by ``DFlashDraft.save`` for ``target``; a bad file or another target's drafter is one InputError line."""
    checkpoint = read_checkpoint(path, "DFlash drafter")
    cfg = checkpoint.section("draftsmith_dflash", DFlashConfig, "DFlash drafter")
    check_dflash_fits(cfg, target)
    draft = dflash_for_target(cfg, target)
    check_tensors(checkpoint.weights, checkpoint.tensors, draft.tensors(), "DFlash")
    state = {name: tensor.float() for name, tensor in checkpoint.tensors.items()}
    state["mask_embedding"] = read_mask_embedding(Path(path), cfg)
    draft.load_state_dict(state)
    return draft.to(target.device).eval()


def read_mask_embedding(path: Path, cfg: DFlashConfig) -> torch.Tensor:
    """``[hidden]`` the mask embedding in ``path/mask_embedding.pt`` (vLLM's file: the tensor, or ``{mask_token_id, embedding}``)."""
    file = path / MASK_EMBEDDING
    try:
        stored = torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InputError(f"DFlash drafter directory {path} has no {MASK_EMBEDDING} (its mask positions' embedding)") from None
    except READ_ERRORS as error:
        raise InputError(f"DFlash mask embedding {file} cannot be read: {error}") from error
    if isinstance(stored, dict):
        if stored.get("mask_token_id", cfg.mask_token_id) != cfg.mask_token_id:
            raise InputError(
                f"DFlash mask embedding {file} is for mask_token_id {stored['mask_token_id']}, the config's is {cfg.mask_token_id}"
            )
        stored = stored.get("embedding")
    if not isinstance(stored, torch.Tensor) or stored.shape != (cfg.hidden_size,):
        shape = tuple(stored.shape) if isinstance(stored, torch.Tensor) else type(stored).__name__
        raise InputError(f"DFlash mask embedding {file} holds {shape}, expected a tensor of shape ({cfg.hidden_size},)")
    return stored.float()


def check_dflash_fits(cfg: DFlashConfig, target: nn.Module) -> None:
    """Raise InputError unless a drafter of shape ``cfg`` reads ``target``'s features and scores its vocabulary."""
    check_fits_target("DFlash drafter", target, cfg.target_hidden_size, cfg.target_num_layers, cfg.vocab_size)


def dflash_for_target(cfg: DFlashConfig, target: nn.Module) -> DFlashDraft:
    """A drafter of shape ``cfg`` sharing ``target``'s embedding and LM head."""
    draft = DFlashDraft(cfg, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return draft.to(target.device)


def dflash_config_for_target(
    target: nn.Module,
    block_size: int = 8,
    num_layers: int = 2,
    aux_layers: list[int] | None = None,
    mask_token_id: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
) -> DFlashConfig:
    """The DFlash shape for ``target``: its width, rotary, heads and vocabulary unless given; the mask token is its pad token by default."""
    layers = int(target.config.num_hidden_layers)
    vocab = output_vocab_size(target)
    mask_token_id = default_mask_token(target) if mask_token_id is None else mask_token_id
    return DFlashConfig(
        hidden_size=target.config.hidden_size,
        target_hidden_size=target.config.hidden_size,
        target_num_layers=layers,
        aux_layers=list(aux_layers) if aux_layers is not None else default_dflash_layers(layers),
        vocab_size=vocab,
        block_size=block_size,
        mask_token_id=mask_token_id,
        num_layers=num_layers,
        **layer_shape(target, num_heads, num_kv_heads, intermediate_size),
    )
