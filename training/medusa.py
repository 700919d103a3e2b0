"""Medusa-1 heads on a frozen target (Cai et al. 2024): only the heads train.

Head k reads the target's final hidden state at position t and learns the target's own
distribution at position t + k (the token t + k + 1): forward KL to it by default, or
cross-entropy to its greedy token; head k's loss is weighted by ``decay ** (k - 1)``.
Held-out evaluation reports each head's top-r accuracy against the target's greedy token
for r = 1 .. ``ranks``, and counts how often each path of ranks (head 1's rank-r1 guess,
head 2's rank-r2 guess, ...) was right all along. The export writes both into
``calibration.json``, from which the proposer grows its tree by the measured path
frequencies (``proposers.static_tree.grow_tree_by_frequency``): the product of per-head
accuracies (the paper's rule) assumes the heads err independently, and they do not.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from draftsmith.proposers.core.errors import InputError, check_integer, check_real
from draftsmith.proposers.medusa_head import DEFAULT_MAX_NODES, MedusaHeads, check_heads_fit, load_heads, write_calibration

from .capture import Captured
from .losses import check_loss, cross_entropy_to, decayed_mean, forward_kl_to, log_probs, masked_mean

MIN_RANKS = 5  # top-1 and top-5 are always reported
LOSSES = ("forward_kl", "cross_entropy")


class MedusaObjective:
    """Train K Medusa heads toward the frozen target (the recipe's ``draft:`` section).

    Args:
        num_heads: K, the tokens guessed beyond the next one.
        num_layers: residual layers per head.
        pretrained: a Medusa heads directory to continue from (None: fresh heads whose LM
            heads start from the target's).
        loss: ``forward_kl`` to the target's distribution, or ``cross_entropy`` to its greedy token.
        decay: head k's loss weight is ``decay ** (k - 1)``.
        temperature: both distributions are softened by it in the KL.
        ranks: held-out top-r accuracies are measured for r = 1 .. ranks (at least 5); the
            calibrated tree uses guesses up to this rank.
        max_nodes: node budget of the calibrated tree stored with the heads.
    """

    hidden_layers: tuple[int, ...] = (-1,)
    needs_logits = True

    def __init__(
        self,
        num_heads: int = 4,
        num_layers: int = 1,
        pretrained: str | None = None,
        loss: Literal["forward_kl", "cross_entropy"] = "forward_kl",
        decay: float = 0.8,
        temperature: float = 1.0,
        ranks: int = 8,
        max_nodes: int = DEFAULT_MAX_NODES,
    ):
        if check_integer("draft.num_heads", num_heads) < 1:
            raise InputError(f"draft.num_heads must be >= 1, got {num_heads}")
        if check_integer("draft.num_layers", num_layers) < 0:
            raise InputError(f"draft.num_layers must be >= 0, got {num_layers}")
        check_loss(loss, LOSSES)
        if not 0.0 < check_real("draft.decay", decay) <= 1.0:
            raise InputError(f"draft.decay must be in (0, 1], got {decay!r}")
        if not 0.0 < check_real("draft.temperature", temperature) < math.inf:
            raise InputError(f"draft.temperature must be a finite number > 0, got {temperature!r}")
        if check_integer("draft.ranks", ranks) < MIN_RANKS:
            raise InputError(f"draft.ranks must be >= {MIN_RANKS} (top-1 and top-5 are reported), got {ranks}")
        if check_integer("draft.max_nodes", max_nodes) < 1:
            raise InputError(f"draft.max_nodes must be >= 1 (the calibrated tree's node budget), got {max_nodes}")
        self.num_heads, self.num_layers, self.pretrained = num_heads, num_layers, pretrained
        self.loss_name, self.decay, self.temperature, self.ranks, self.max_nodes = loss, decay, temperature, ranks, max_nodes
        self.path_histogram: torch.Tensor | None = None  # rank-tuple counts of the last held-out evaluation
        self._counting = False  # whether an evaluation is under way (training steps end it)

    def check(self, target: nn.Module, tokenizer) -> None:
        if self.pretrained is not None and not Path(self.pretrained).is_dir():
            raise FileNotFoundError(f"draft.pretrained {self.pretrained} is not a directory")

    def build(self, target: nn.Module, tokenizer, rows=None) -> nn.Module:
        """The heads: loaded from ``pretrained`` (checked against the target), or fresh from the target's LM head."""
        if self.pretrained is None:
            return MedusaHeads.for_target(target, self.num_heads, self.num_layers)
        heads = load_heads(self.pretrained)
        check_heads_fit(heads, target)
        if (heads.num_heads, heads.num_layers) != (self.num_heads, self.num_layers):
            raise InputError(
                f"draft.pretrained has {heads.num_heads} heads of {heads.num_layers} layer(s), "
                f"the recipe asks for {self.num_heads} of {self.num_layers}"
            )
        return heads

    def loss(self, heads: nn.Module, batch: dict[str, torch.Tensor], captured: Captured) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The decayed sum of every head's loss, normalised by the weights.

        Metrics: each head's KL to the target, and in eval mode its top-r accuracies.
        """
        mask, target_logits = batch["loss_mask"], captured.logits  # [batch, seq], [batch, seq, vocab]
        head_logits = heads(captured.hidden[-1].float())  # [heads, batch, seq, vocab]
        seq = mask.shape[1]
        # Once for every head: the target's log-probs (at the loss temperature, and at 1) and greedy tokens.
        target_logp = log_probs(target_logits, self.temperature)
        plain_logp = target_logp if self.temperature == 1.0 else log_probs(target_logits, 1.0)
        greedy = target_logits.argmax(-1)  # [batch, seq]
        losses, metrics = [], {}
        for k in range(1, min(head_logits.shape[0], seq - 1) + 1):
            # head k at position t guesses token t + k + 1: the target's row t + k
            guess, counted = head_logits[k - 1][:, : seq - k], mask[:, k:]
            if self.loss_name == "forward_kl":
                head_loss = forward_kl_to(guess, target_logp[:, k:], counted, self.temperature)
            else:
                head_loss = cross_entropy_to(guess, greedy[:, k:], counted)
            losses.append(head_loss)
            with torch.no_grad():
                plain = (
                    head_loss.detach()
                    if self.loss_name == "forward_kl" and self.temperature == 1.0
                    else forward_kl_to(guess, plain_logp[:, k:], counted)
                )
                metrics[f"h{k}_kl"] = plain
                if not heads.training:  # held-out evaluation: the top-r accuracies (a topk over the vocabulary per head)
                    metrics.update(top_r_accuracy(guess, greedy[:, k:], counted, self.ranks, prefix=f"h{k}_top"))
        if heads.training:
            self._counting = False
        else:
            self._count_paths(head_logits, greedy, mask)
        return decayed_mean(losses, self.decay), metrics

    def _count_paths(self, head_logits: torch.Tensor, greedy: torch.Tensor, mask: torch.Tensor) -> None:
        """Add this held-out batch's rank tuples to the counts of the current evaluation (a new one starts after training steps).

        Position t's tuple holds, for each head k, the rank of the target's token t + k + 1
        among head k's top guesses (``ranks`` for none). The export turns the last
        evaluation's counts into the frequency of every rank path.
        """
        heads_count, seq = head_logits.shape[0], mask.shape[1]
        if seq <= heads_count:
            return
        rows = seq - heads_count  # positions where every head has an answer
        code = torch.zeros(mask.shape[0], rows, dtype=torch.long, device=mask.device)
        counted = torch.ones_like(code, dtype=torch.bool)
        with torch.no_grad():
            for k in range(1, heads_count + 1):
                top = head_logits[k - 1][:, :rows].topk(self.ranks, dim=-1).indices  # [batch, rows, ranks]
                hit = top == greedy[:, k : k + rows].unsqueeze(-1)
                rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(code, self.ranks))
                code += rank * (self.ranks + 1) ** (k - 1)
                counted &= mask[:, k : k + rows]
        counts = torch.bincount(code[counted].cpu(), minlength=(self.ranks + 1) ** heads_count)
        if not self._counting:
            self.path_histogram, self._counting = torch.zeros_like(counts), True
        self.path_histogram += counts

    def export(self, heads: nn.Module, out_dir: Path, tokenizer, dtype: torch.dtype, heldout: dict | None = None) -> None:
        """The heads in vLLM's layout, and ``calibration.json`` from the last held-out evaluation (accuracies, rank-path counts)."""
        heads.save(out_dir, dtype)
        if heldout is None:
            print(f"no held-out data: {out_dir} has no calibration.json, so its proposer config needs tree: [[0], ...] rank paths")
            return
        counts = path_counts(self.path_histogram, heads.num_heads, self.ranks) if self.path_histogram is not None else None
        accuracy = rank_accuracy(heldout, heads.num_heads, self.ranks)
        write_calibration(out_dir, accuracy, int(heldout.get("tokens", 0)), self.max_nodes, counts)


def path_counts(histogram: torch.Tensor, num_heads: int, ranks: int) -> dict[tuple[int, ...], int]:
    """Rank tuples counted per code (base ``ranks + 1``, ``ranks`` = no hit) -> how often each rank path was right all along."""
    counts: dict[tuple[int, ...], int] = {}
    for code in histogram.nonzero().flatten().tolist():
        n, digits = int(histogram[code]), []
        for _ in range(num_heads):
            code, digit = divmod(code, ranks + 1)
            digits.append(digit)
        for depth in range(1, num_heads + 1):
            if digits[depth - 1] == ranks:
                break
            prefix = tuple(digits[:depth])
            counts[prefix] = counts.get(prefix, 0) + n
    return counts


def top_r_accuracy(guess: torch.Tensor, wanted: torch.Tensor, mask: torch.Tensor, ranks: int, prefix: str) -> dict[str, torch.Tensor]:
    """``{prefix + str(r): share of masked positions whose wanted token is among the top r guesses}`` for r = 1 .. ranks.

    Args:
        guess: ``[batch, seq, vocab]`` a head's logits; wanted: ``[batch, seq]`` the target's greedy tokens; mask: ``[batch, seq]``.
    """
    top = guess.topk(ranks, dim=-1).indices  # [batch, seq, ranks]
    cumulative = (top == wanted.unsqueeze(-1)).float().cumsum(-1)  # [batch, seq, ranks], at most one hit per position
    return {f"{prefix}{r}": masked_mean(cumulative[..., r - 1], mask) for r in range(1, ranks + 1)}


def rank_accuracy(heldout: dict, num_heads: int, ranks: int) -> list[list[float]]:
    """Per head, how often its guess of each rank was the target's token: differences of the top-r accuracies."""
    table = []
    for k in range(1, num_heads + 1):
        top = [0.0] + [float(heldout.get(f"h{k}_top{r}", 0.0)) for r in range(1, ranks + 1)]
        table.append([round(max(top[r] - top[r - 1], 0.0), 4) for r in range(1, ranks + 1)])
    return table
