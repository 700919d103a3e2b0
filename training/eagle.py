"""EAGLE heads on a frozen target: EAGLE-1's feature regression, EAGLE-3's training-time test.

- EAGLE-1 (Li et al. 2024): teacher-forced on the target's features. The entry at
  position i reads (token i + 1, feature i) and its output g_i must predict the feature
  of position i + 1 (smooth L1) and, through the target's LM head, the target's
  distribution there (forward KL, weighted by ``ce_weight``).
- EAGLE-3 (Li et al. 2025): the training-time test. Step 0 reads the fused target
  features; step j reads the draft's own outputs of step j - 1 and the token j places
  further, exactly as the draft runs when it grows a tree. Row i of step j attends to
  the step-0 entries at positions <= i (the context) and to its own entries of steps
  1 .. j (its ancestors), at rotary position i + j. Every step's loss is the forward KL
  to the target's distribution restricted to the draft vocabulary, weighted by
  ``decay ** j``. Held-out evaluation reports the top-1 acceptance of every step.

- P-EAGLE (``parallel: true``; EAGLE-3 only): the same unrolled steps, but step j > 0 reads
  the mask token and the learned ``mask_hidden`` instead of the token j places further and
  step j - 1's outputs, as the parallel head drafts every depth in one forward. The
  attention is the training-time test's: row i of step j sees the context rows <= i and its
  own rows of steps 1 .. j, which is the causal attention of the mask entries at drafting.

The draft vocabulary (EAGLE-3) is the ``draft_vocab_size`` most frequent tokens of the
training data.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.proposers.core.errors import InputError, check_integer, check_real
from draftsmith.proposers.eagle_head import EagleDraft, config_for_target, draft_for_target, load_draft, read_head_config

from .capture import Captured
from .common import check_same_shape
from .losses import decayed_mean, forward_kl_to, masked_mean

FREQUENCY_ROWS = 20000  # training rows counted to choose the draft vocabulary


class EagleObjective:
    """Train an EAGLE-1 or EAGLE-3 draft toward the frozen target (the recipe's ``draft:`` section).

    Args:
        version: 1 or 3.
        aux_layers: EAGLE-3's low / mid / high target layers (``output_hidden_states`` ids;
            None: ``[2, N // 2, N - 3]``, written explicitly into the export).
        draft_vocab_size: EAGLE-3's draft vocabulary, the most frequent training tokens (None: the target's).
        ttt_steps: EAGLE-3's unrolled steps (at least 1).
        decay: step j's loss weight is ``decay ** j``.
        feature_weight: EAGLE-1's smooth-L1 feature loss weight.
        ce_weight: EAGLE-1's distribution loss weight (the paper's 0.1).
        num_heads, num_kv_heads, intermediate_size: the draft layer (None: the target's).
        init_from: start from a head saved by an earlier run for this target (an
            ``EagleDraft.save`` directory, e.g. a first stage on shorter blocks) instead of a
            fresh one; its shape, aux layers and draft vocabulary must be the ones this
            recipe describes.
        parallel: train a P-EAGLE head that drafts ``ttt_steps`` depths in one forward (EAGLE-3).
        mask_token_id: the token a parallel head's mask entries embed (None: the target's pad token).
    """

    needs_logits = True

    def __init__(
        self,
        version: int = 3,
        aux_layers: list[int] | None = None,
        draft_vocab_size: int | None = None,
        ttt_steps: int = 6,
        decay: float = 1.0,
        feature_weight: float = 1.0,
        ce_weight: float = 0.1,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        intermediate_size: int | None = None,
        init_from: str | None = None,
        parallel: bool = False,
        mask_token_id: int | None = None,
    ):
        if version not in (1, 3):
            raise InputError(f"draft.version must be 1 or 3, got {version!r}")
        if not isinstance(parallel, bool):
            raise InputError(f"draft.parallel must be true or false, got {parallel!r}")
        if parallel and version != 3:
            raise InputError("draft.parallel (P-EAGLE) is an EAGLE-3 option: set draft.version: 3")
        if mask_token_id is not None and not parallel:
            raise InputError("draft.mask_token_id is for parallel heads (draft.parallel: true)")
        if check_integer("draft.ttt_steps", ttt_steps) < 1:
            raise InputError(f"draft.ttt_steps must be >= 1, got {ttt_steps}")
        if draft_vocab_size is not None and check_integer("draft.draft_vocab_size", draft_vocab_size) < 1:
            raise InputError(f"draft.draft_vocab_size must be >= 1, got {draft_vocab_size}")
        if version == 1 and (aux_layers is not None or draft_vocab_size is not None):
            raise InputError("draft.aux_layers and draft.draft_vocab_size are EAGLE-3 keys (version: 3)")
        for name, value in (("decay", decay), ("feature_weight", feature_weight), ("ce_weight", ce_weight)):
            if not 0.0 <= check_real(f"draft.{name}", value) < math.inf:
                raise InputError(f"draft.{name} must be a finite number >= 0, got {value!r}")
        self.version, self.aux_layers, self.draft_vocab_size, self.ttt_steps = version, aux_layers, draft_vocab_size, ttt_steps
        self.decay, self.feature_weight, self.ce_weight = decay, feature_weight, ce_weight
        self.shape = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "intermediate_size": intermediate_size}
        self.shape |= {"parallel_depth": ttt_steps if parallel else 0, "mask_token_id": mask_token_id}
        self.init_from = init_from
        self.hidden_layers: tuple[int, ...] = (-1,) if version == 1 else tuple(aux_layers or ())

    def check(self, target: nn.Module, tokenizer) -> None:
        """Resolve the aux layers against the target (so that capture knows them) and check them and the vocabulary size."""
        self.config = config_for_target(target, self.version, self.aux_layers, self.draft_vocab_size, **self.shape)
        self.hidden_layers = tuple(self.config.aux_layers)
        if self.init_from is not None:
            check_same_shape(self.init_from, read_head_config(self.init_from), self.config)

    def build(self, target: nn.Module, tokenizer, rows=None) -> nn.Module:
        """A fresh draft for the target (EAGLE-3's vocabulary from the token frequencies of ``rows``), or ``init_from``'s."""
        self.check(target, tokenizer)
        if self.init_from is not None:
            return load_draft(self.init_from, target)  # its vocabulary maps and LM head come with it
        draft = draft_for_target(self.config, target)
        cfg = self.config
        if cfg.version == 3 and cfg.draft_vocab_size < cfg.vocab_size:
            if rows is None:
                raise InputError("a reduced draft vocabulary is chosen from the training data's token frequencies: no rows were given")
            draft.set_vocabulary(most_frequent(token_frequencies(rows, cfg.vocab_size, FREQUENCY_ROWS), cfg.draft_vocab_size))
        if cfg.version == 3:
            start_from_target_head(draft, target)
        return draft

    def loss(self, draft: nn.Module, batch: dict[str, torch.Tensor], captured: Captured) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """EAGLE-1: smooth L1 + ce_weight x KL; EAGLE-3: the decayed KL of every unrolled step. Metrics: per-step acceptance."""
        if draft.cfg.version == 1:
            return eagle1_loss(draft, batch, captured, self.feature_weight, self.ce_weight)
        return ttt_loss(draft, batch, captured, self.hidden_layers, self.ttt_steps, self.decay)

    def export(self, draft: nn.Module, out_dir: Path, tokenizer, dtype: torch.dtype, heldout: dict | None = None) -> None:
        draft.save(out_dir, dtype)


@torch.no_grad()
def start_from_target_head(draft: EagleDraft, target: nn.Module) -> None:
    """EAGLE-3: start the draft's LM head from the target's rows of the draft vocabulary, and its norm from the target's final norm.

    The head then scores the draft's outputs in the target's own output space from step 0:
    a random head left held-out step-0 acceptance at 0.33 after 500 steps on the demo,
    below the EAGLE-1 head (the target's own LM head, 0.41).
    """
    head = target.get_output_embeddings()
    if head is not None and head.weight.shape[1] == draft.lm_head.weight.shape[1]:
        draft.lm_head.weight.copy_(head.weight[draft.draft_to_target()].to(draft.lm_head.weight))
    norm = getattr(target.get_decoder(), "norm", None)
    if getattr(norm, "weight", None) is not None and norm.weight.shape == draft.norm.weight.shape:
        draft.norm.weight.copy_(norm.weight.to(draft.norm.weight))


def _targets(draft: EagleDraft, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's log-probs over the draft vocabulary (renormalised there) ``[batch, seq, draft_vocab]``, and its greedy tokens."""
    logp = F.log_softmax(target_logits.float(), dim=-1)
    if draft.cfg.version == 3 and draft.cfg.draft_vocab_size < draft.cfg.vocab_size:
        logp = logp[..., draft.draft_to_target()]
        logp = logp - torch.logsumexp(logp, dim=-1, keepdim=True)
    return logp, target_logits.argmax(-1)


def _accepted(draft: EagleDraft, draft_logits: torch.Tensor, greedy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share of masked rows whose draft argmax (as a target id) is the target's greedy token."""
    guess = draft_logits.argmax(-1)
    if draft.cfg.version == 3:
        guess = draft.draft_to_target()[guess]
    return masked_mean((guess == greedy).float(), mask)


def eagle1_loss(draft: EagleDraft, batch, captured: Captured, feature_weight: float, ce_weight: float):
    """Teacher-forced EAGLE-1: rows i = 0 .. S - 2 read (token i + 1, feature i) and predict feature and distribution at i + 1."""
    tokens, mask = batch["input_ids"], batch["loss_mask"]
    features = captured.hidden[-1].float()  # [batch, seq, hidden]
    target_logp, greedy = _targets(draft, captured.logits)
    seq = tokens.shape[1]
    out = _run_step(draft, tokens[:, 1:], features[:, :-1], torch.arange(seq - 1, device=tokens.device), [])  # [batch, seq - 1, hidden]
    counted = mask[:, 1:]
    feature_loss = masked_mean(F.smooth_l1_loss(out, features[:, 1:], reduction="none").mean(-1), counted)
    logits = draft.logits(out)
    kl = forward_kl_to(logits, target_logp[:, 1:], counted)
    metrics = {"feature_l1": feature_loss.detach(), "kl": kl.detach(), "acc0": _accepted(draft, logits.detach(), greedy[:, 1:], counted)}
    return feature_weight * feature_loss + ce_weight * kl, metrics


def ttt_loss(draft: EagleDraft, batch, captured: Captured, layers: tuple[int, ...], steps: int, decay: float):
    """EAGLE-3's training-time test over ``steps`` unrolled steps (see the module docstring)."""
    mask = batch["loss_mask"]
    target_logp, greedy = _targets(draft, captured.logits)
    losses, metrics = [], {}
    for j, logits in enumerate(unrolled_logits(draft, batch["input_ids"], captured, layers, steps)):
        valid = logits.shape[1]
        counted = mask[:, j + 1 : j + 1 + valid]
        kl = forward_kl_to(logits, target_logp[:, j + 1 : j + 1 + valid], counted)
        losses.append(kl)
        metrics[f"kl{j}"] = kl.detach()
        metrics[f"acc{j}"] = _accepted(draft, logits.detach(), greedy[:, j + 1 : j + 1 + valid], counted)
    return decayed_mean(losses, decay), metrics


def unrolled_logits(draft: EagleDraft, tokens: torch.Tensor, captured: Captured, layers: tuple[int, ...], steps: int):
    """Yield the draft logits ``[batch, seq - 1 - j, draft_vocab]`` of each unrolled step j: row i guesses token i + j + 2.

    A parallel head's steps j > 0 read its mask entries instead of tokens and their own outputs.
    """
    seq = tokens.shape[1]
    rows = seq - 1  # step j's row i reads token i + j + 1 and is scored against the target's row i + j + 1
    positions = torch.arange(rows, device=tokens.device)
    hidden = draft.fuse(torch.cat([captured.hidden[layer].float() for layer in layers], dim=-1))[:, :rows]  # [batch, rows, hidden]
    keys: list = []
    for j in range(min(steps, rows)):
        step_tokens = _shifted(tokens, j, rows)
        if j and draft.cfg.parallel_depth:
            step_tokens, hidden = draft.mask_inputs(rows, tokens.shape[0])
        out = _run_step(draft, step_tokens, hidden, positions + j, keys)
        yield draft.logits(out[:, : rows - j])
        hidden = out  # a sequential head's next step reads this step's outputs


def _shifted(tokens: torch.Tensor, j: int, rows: int) -> torch.Tensor:
    """Tokens i + j + 1 for rows i < rows, padded past the end with the last token (those rows are masked out of the loss)."""
    part = tokens[:, j + 1 : j + 1 + rows]
    if part.shape[1] < rows:
        part = torch.cat([part, part[:, -1:].expand(-1, rows - part.shape[1])], dim=1)
    return part


def _run_step(draft: EagleDraft, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, keys: list) -> torch.Tensor:
    """One unrolled step over every row at once; ``keys`` collects (k, v) of the steps so far (step 0's first).

    Step 0 attends causally over its own rows; step j > 0 attends to step 0's rows <= i
    and to row i of steps 1 .. j (its own and its ancestors' entries).
    """
    x, residual = draft.layer_input(draft.embed(tokens), hidden)
    attn = draft.layer.self_attn
    cos, sin = draft.rotary(positions)
    q, k, v = attn.qkv(x, cos, sin)
    keys.append((attn.expand_kv(k), attn.expand_kv(v)))
    if len(keys) == 1:
        attended = F.scaled_dot_product_attention(q, keys[0][0], keys[0][1], is_causal=True)
        return draft.layer.finish(residual, attended)
    return draft.layer.finish(residual, ancestor_attention(q, keys))


def ancestor_attention(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Row i attends to the context rows <= i (``keys[0]``) and to row i of every later step's entries.

    One softmax over both parts, written out so that nothing of size ``rows x rows`` is
    concatenated or sliced: autograd would allocate a zero-filled copy of that size for
    every slice's gradient, which cost more than the attention itself at 1024 rows.
    The scale and the causal mask go into the score matmul (``baddbmm``); the shift by
    the row maximum is a constant for autograd (softmax does not depend on it).

    Args:
        q: ``[batch, heads, rows, d]``; keys: ``(k, v)`` pairs ``[batch, heads, rows, d]``, the context's first.
    """
    batch, heads, rows, d = q.shape
    scale = 1.0 / math.sqrt(d)
    (k0, v0), own = keys[0], keys[1:]
    blocked = torch.full((rows, rows), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
    flat = batch * heads
    context = torch.baddbmm(blocked[None], q.reshape(flat, rows, d), k0.reshape(flat, rows, d).transpose(1, 2), alpha=scale)
    own_scores = torch.stack([(q * k_s).sum(-1) * scale for k_s, _ in own], dim=-1).reshape(flat, rows, len(own))
    shift = torch.maximum(context.amax(-1), own_scores.amax(-1)).detach()[..., None]  # [flat, rows, 1]
    context, own_scores = torch.exp(context - shift), torch.exp(own_scores - shift)
    total = context.sum(-1, keepdim=True) + own_scores.sum(-1, keepdim=True)
    attended = torch.bmm(context, v0.reshape(flat, rows, d))
    for s, (_, v_s) in enumerate(own):
        attended = attended + own_scores[..., s : s + 1] * v_s.reshape(flat, rows, d)
    return (attended / total).reshape(batch, heads, rows, d)


def token_frequencies(rows, vocab_size: int, max_rows: int | None = None) -> torch.Tensor:
    """``[vocab]`` counts of the token ids in ``rows`` (each ``{"input_ids": [...]}``), for choosing a draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i, row in enumerate(rows):
        if max_rows is not None and i >= max_rows:
            break
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long).reshape(-1)
        counts += torch.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
    return counts


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids (ties to the lower id), ascending."""
    order = torch.sort(counts, descending=True, stable=True).indices[:size]
    if counts[order].sum() == 0:
        warnings.warn("no token counts: the draft vocabulary is the first ids", stacklevel=2)
    return order.sort().values
