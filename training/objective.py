"""The training seam: what a draft family tells the one training loop.

A family is one ``Objective`` class in its own file: it builds the trainable draft or heads
from the frozen target, computes the loss of a batch from what ``training.capture`` captured,
and exports a directory that ``{type: <family>, model: DIR}`` loads as a proposer. Its
constructor's arguments are the recipe's ``draft:`` section (checked by the config loader).
The loop (``training.train``) never asks which family it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from draftsmith.proposers.core.config import resolve_type

from .capture import Captured


@runtime_checkable
class Objective(Protocol):
    """One family's training objective.

    Attributes:
        hidden_layers: target layers the loss needs (``output_hidden_states`` indices, see
            ``training.capture``); empty for a draft LM.
        needs_logits: whether the loss needs the target's logits.
    """

    hidden_layers: tuple[int, ...]
    needs_logits: bool

    def check(self, target: nn.Module, tokenizer) -> None:
        """Raise ValueError when this objective cannot train against ``target`` (before any slow work)."""

    def build(self, target: nn.Module, tokenizer, rows=None) -> nn.Module:
        """The trainable draft or heads, fresh or loaded; only its trainable parameters get gradients.

        ``rows`` are the training rows (``{"input_ids": ...}``), for families that choose
        something from the data (EAGLE-3's draft vocabulary from token frequencies).
        """

    def loss(self, draft: nn.Module, batch: dict[str, torch.Tensor], captured: Captured) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The scalar loss of ``batch`` (``input_ids`` / ``loss_mask`` ``[batch, seq]``) and metrics.

        Metrics are scalar tensors, each a mean over the batch's ``loss_mask`` positions
        (they are logged while training and averaged over held-out batches).
        """

    def export(self, draft: nn.Module, out_dir: Path, tokenizer, dtype: torch.dtype, heldout: dict | None = None) -> None:
        """Write the trained draft into ``out_dir`` (an empty directory) in the layout its proposer loads.

        ``heldout`` holds the last held-out loss and metrics (None without held-out data),
        for families that store measurements with their weights (Medusa's calibrated tree).
        """


#: ``type`` of a training recipe -> "module:Class" (or the class itself)
OBJECTIVES: dict[str, str | type] = {
    "draft_lm": "draftsmith.training.draft_lm:DraftLMObjective",
    "medusa": "draftsmith.training.medusa:MedusaObjective",
    "eagle": "draftsmith.training.eagle:EagleObjective",
    "dflash": "draftsmith.training.dflash:DFlashObjective",
    "mtp": "draftsmith.training.mtp:MtpObjective",
}


def objective_class(kind: str) -> type:
    """The Objective class registered as ``kind``; an unknown kind lists the available ones."""
    return resolve_type({"type": kind}, OBJECTIVES, "training")
