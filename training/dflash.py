"""DFlash block drafters on a frozen target: every sampled anchor's block at once, in one forward.

DFlash (Chen et al. 2026) trains its drafter on blocks that start at anchors sampled in
the text: the block at anchor ``a`` holds token ``a`` and ``block_size - 1`` mask
positions (positions ``a .. a + B - 1``), attends to the fused target features of the
positions before ``a`` (never to ``a``'s own, which drafting does not have yet) and to
its own block, and its position ``j`` learns the target's distribution after position
``a + j - 1`` (the token ``j`` places after the anchor): forward KL (``loss: forward_kl``)
or cross-entropy to the target's greedy token (``loss: cross_entropy``), weighted by
``decay ** (j - 1)`` (the paper's exponential decay over block positions: later guesses
count only when the earlier ones were accepted).

All the anchors of a batch run as one set of block rows over the sequence's context keys,
each block row masked to its own context and its own block (``block_mask``): the same
``DFlashLayer`` the proposer runs, so one block here equals one drafting step
(``tests/proposers/test_dflash.py``). Training samples ``anchors_per_row`` anchors at
random per batch; held-out evaluation spaces them evenly (reproducible metrics). Metrics:
``kl{j}`` and ``acc{j}``, the top-1 agreement with the target at block position ``j + 1``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from draftsmith.proposers.core.errors import InputError, check_integer, check_real
from draftsmith.proposers.dflash_head import DFlashDraft, dflash_config_for_target, dflash_for_target, load_dflash, read_dflash_config

from .capture import Captured
from .common import check_same_shape
from .losses import check_loss, cross_entropy_to, decayed_mean, forward_kl_to, log_probs, masked_mean

LOSSES = ("forward_kl", "cross_entropy")


class DFlashObjective:
    """Train a DFlash drafter toward the frozen target (the recipe's ``draft:`` section).

    Args:
        block_size: positions per block (the anchor and ``block_size - 1`` guesses).
        num_layers: the drafter's decoder layers.
        aux_layers: the target layers it reads (``output_hidden_states`` ids; None: 4 spread over ``[1, N - 1]``).
        mask_token_id: the token id engines embed for the mask positions (None: the target's pad token).
        anchors_per_row: anchors (blocks) sampled per sequence and batch.
        loss: ``forward_kl`` or ``cross_entropy``.
        decay: block position j's loss weight is ``decay ** (j - 1)``.
        num_heads, num_kv_heads, intermediate_size: each layer's shape (None: the target's).
        init_from: start from a drafter saved by an earlier run for this target (same shape).
    """

    needs_logits = True

    def __init__(
        self,
        block_size: int = 8,
        num_layers: int = 2,
        aux_layers: list[int] | None = None,
        mask_token_id: int | None = None,
        anchors_per_row: int = 32,
        loss: Literal["forward_kl", "cross_entropy"] = "forward_kl",
        decay: float = 0.8,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        intermediate_size: int | None = None,
        init_from: str | None = None,
    ):
        for name, value, least in (("block_size", block_size, 2), ("num_layers", num_layers, 1), ("anchors_per_row", anchors_per_row, 1)):
            if check_integer(f"draft.{name}", value) < least:
                raise InputError(f"draft.{name} must be >= {least}, got {value}")
        check_loss(loss, LOSSES)
        if not 0.0 <= check_real("draft.decay", decay) < math.inf:
            raise InputError(f"draft.decay must be a finite number >= 0, got {decay!r}")
        self.shape = {
            "block_size": block_size,
            "num_layers": num_layers,
            "aux_layers": aux_layers,
            "mask_token_id": mask_token_id,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "intermediate_size": intermediate_size,
        }
        self.anchors_per_row, self.loss_name, self.decay, self.init_from = anchors_per_row, loss, float(decay), init_from
        self.hidden_layers: tuple[int, ...] = tuple(aux_layers or ())

    def check(self, target: nn.Module, tokenizer) -> None:
        """Resolve the shape against the target (the aux layers, so that capture knows them); check ``init_from``'s."""
        self.config = dflash_config_for_target(target, **self.shape)
        self.hidden_layers = tuple(self.config.aux_layers)
        if self.init_from is not None:
            check_same_shape(self.init_from, read_dflash_config(self.init_from), self.config)

    def build(self, target: nn.Module, tokenizer, rows=None) -> nn.Module:
        """A fresh drafter (its final norm started from the target's), or ``init_from``'s."""
        self.check(target, tokenizer)
        if self.init_from is not None:
            return load_dflash(self.init_from, target)
        draft = dflash_for_target(self.config, target)
        norm = getattr(target.get_decoder(), "norm", None)
        if getattr(norm, "weight", None) is not None and norm.weight.shape == draft.norm.weight.shape:
            with torch.no_grad():
                draft.norm.weight.copy_(norm.weight)
        return draft

    def loss(self, draft: DFlashDraft, batch: dict[str, torch.Tensor], captured: Captured) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The decayed loss over block positions; metrics ``kl{j}`` / ``acc{j}`` per position."""
        tokens, mask = batch["input_ids"], batch["loss_mask"]
        seq = tokens.shape[1]
        anchors = choose_anchors(seq, self.anchors_per_row, random=draft.training, device=tokens.device)
        features = torch.cat([captured.hidden[layer].float() for layer in self.hidden_layers], dim=-1)
        logits = block_logits(draft, tokens, features, anchors)  # [batch, n, block - 1, vocab]
        rows = anchors[:, None] + torch.arange(
            draft.cfg.block_size - 1, device=tokens.device
        )  # [n, block - 1]: the target row each guesses
        inside = rows < seq
        rows = rows.clamp(max=seq - 1)
        target_logp = log_probs(captured.logits, 1.0)[:, rows]  # [batch, n, block - 1, vocab]
        greedy = captured.logits.argmax(-1)[:, rows]
        counted = mask[:, rows] & inside
        losses, metrics = [], {}
        for j in range(logits.shape[2]):
            kl = forward_kl_to(logits[:, :, j], target_logp[:, :, j], counted[:, :, j])
            losses.append(kl if self.loss_name == "forward_kl" else cross_entropy_to(logits[:, :, j], greedy[:, :, j], counted[:, :, j]))
            metrics[f"kl{j}"] = kl.detach()
            metrics[f"acc{j}"] = masked_mean((logits[:, :, j].detach().argmax(-1) == greedy[:, :, j]).float(), counted[:, :, j])
        return decayed_mean(losses, self.decay), metrics

    def export(self, draft: DFlashDraft, out_dir: Path, tokenizer, dtype: torch.dtype, heldout: dict | None = None) -> None:
        draft.save(out_dir, dtype)


def choose_anchors(seq: int, count: int, random: bool, device=None) -> torch.Tensor:
    """``[n]`` ascending anchor positions in ``[1, seq - 1]`` (an anchor needs one position of context before it).

    Random (training: a fresh draw per batch from torch's generator) or evenly spaced (held-out).
    """
    if seq < 2:
        raise InputError(f"a DFlash block needs at least 2 positions of text (one of context and the anchor), got sequences of {seq}")
    count = min(count, seq - 1)
    if random:
        return (torch.randperm(seq - 1)[:count] + 1).sort().values.to(device)
    return torch.linspace(1, seq - 1, count).round().long().unique().to(device)


def block_mask(anchors: torch.Tensor, seq: int, block_size: int) -> torch.Tensor:
    """bool ``[n * block, seq + n * block]``: a block row sees the context before its anchor and its own block."""
    n = anchors.shape[0]
    owner = torch.arange(n, device=anchors.device).repeat_interleave(block_size)  # [n * block] the block of each row
    context = torch.arange(seq, device=anchors.device)[None, :] < anchors[owner][:, None]
    return torch.cat([context, owner[:, None] == owner[None, :]], dim=1)


def block_logits(draft: DFlashDraft, tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The drafter's logits ``[batch, n, block - 1, vocab]`` of the blocks at ``anchors`` ``[n]``.

    Args:
        tokens: ``[batch, seq]``; features: ``[batch, seq, n_aux * target_hidden]`` the aux layers side by side.
    """
    batch, seq = tokens.shape
    block = draft.cfg.block_size
    context = draft.context(features)  # [batch, seq, hidden]
    context_cos, context_sin = draft.rotary(torch.arange(seq, device=tokens.device))
    cos, sin = draft.rotary((anchors[:, None] + torch.arange(block, device=tokens.device)).reshape(-1))
    hidden = draft.block_inputs(tokens[:, anchors])  # [batch, n * block, hidden]
    mask = block_mask(anchors, seq, block)
    for layer in draft.layers:
        hidden = layer(hidden, cos, sin, layer.context_kv(context, context_cos, context_sin), mask)
    return draft.logits(hidden.view(batch, anchors.shape[0], block, -1)[:, :, 1:]).float()
