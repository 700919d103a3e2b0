"""Medusa: K heads on the target's last hidden state guess the K tokens after the next one.

Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads". Head k (1-based) reads the final normed hidden state of position t and
guesses the token at t + k + 1: a residual SiLU block (or several) and its own LM head,
which starts from the target's. The heads' top guesses form a fixed tree of rank paths
(``medusa_choices``), scored by the verifier in one forward. The tree is given, or grown
to a node budget from how often each path of guesses was right on held-out text when
the heads were trained (``calibration.json``, ``proposers.static_tree.grow_tree_by_frequency``).

Every node is a deterministic guess, so the verifier treats it as a point mass and the
output follows the target's distribution exactly at every temperature. There is no
"typical acceptance" (the paper's lossy mode).

The heads, their checkpoints (vLLM's layout, which ``export`` writes and checks, and
FasterDecoding's) and their calibration are ``proposers.medusa_head``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from .core.devices import host_lists
from .core.engine import EngineExport, check_format, write_export, write_spec
from .core.errors import InputError, check_integer
from .core.proposer import ProposerBase
from .core.static_tree import RankPath, StaticTree, static_tree
from .core.types import Draft, ProposeContext, TargetFeatures, VerifyResult
from .medusa_head import CALIBRATION, DEFAULT_MAX_NODES, MedusaHeads, check_heads_fit, grow_calibrated_tree, load_heads, read_calibration


class MedusaProposer(ProposerBase):
    """Draft a fixed tree of the Medusa heads' top guesses.

    Args:
        model: ``MedusaHeads``, or a directory holding them (and ``calibration.json`` when
            they were trained here).
        tree: the tree as rank paths (``medusa_choices``: ``[[0], [1], [0, 0], ...]``);
            None grows the calibrated tree stored with the heads to ``max_nodes``.
        max_nodes: node budget of the calibrated tree (default: the one it was stored with,
            else 16); it cuts a given ``tree`` too (breadth first).
        target: the target model; when given, the heads' hidden size and vocabulary are checked against it.
    """

    hidden_layers: tuple[int, ...] = (-1,)  # the final normed state, which the target's LM head reads

    def __init__(
        self,
        model: MedusaHeads | str | Path,
        tree: list[list[int]] | None = None,
        max_nodes: int | None = None,
        target: nn.Module | None = None,
    ):
        if max_nodes is not None and check_integer("max_nodes", max_nodes) < 1:
            raise InputError(f"max_nodes must be >= 1 (a tree of at least one node), got {max_nodes}")
        self.calibration = None
        if isinstance(model, (str, Path)):
            self.calibration = read_calibration(Path(model))
            model = load_heads(model)
        if target is not None:
            check_heads_fit(model, target)
            model = model.to(target.device)
        self.heads = model.eval()
        self.device = next(model.parameters()).device
        self.vocab_size = model.vocab_size
        self.tree = _choose_tree(tree, self.calibration, max_nodes, model.num_heads)
        self._hidden: torch.Tensor | None = None  # final hidden state of the last committed position the target scored
        self._subtrees: dict[tuple[int, int], StaticTree] = {}  # (depth, width) -> the tree's part a step drafts

    def draft_depth(self) -> int:
        return self.tree.depth

    def draft_width(self) -> int:
        return self.tree.width

    def begin(self, prompt: list[int], features: TargetFeatures | None) -> None:
        self._hidden = _last_state(features, self.device)

    def observe(self, result: VerifyResult, features: TargetFeatures | None) -> None:
        self._hidden = _last_state(features, self.device)

    @torch.inference_mode()
    def propose(self, context: ProposeContext) -> Draft:
        """The tree's tokens from the heads' guesses after the last scored position."""
        if self._hidden is None:
            return Draft.empty()
        tree = self._subtree(context.max_depth, context.max_width)
        # only the heads the tree reaches; one product each (a batched bmm is 5x slower for matrix-vector on a CPU)
        logits = torch.stack([self.heads.lm_heads[d](self.heads.blocks[d](self._hidden)) for d in range(tree.depth)])  # [depth, vocab]
        top = logits.float().softmax(-1).topk(tree.width, dim=-1)  # [depth, width]
        indices, values = host_lists(top.indices, top.values)  # one read
        at = list(zip(tree.depths.tolist(), tree.ranks.tolist(), strict=True))  # the tree's own lists: on the CPU, free
        tokens = [indices[depth - 1][rank] for depth, rank in at]
        return Draft(torch.tensor(tokens, dtype=torch.long), tree.parents, scores=[values[depth - 1][rank] for depth, rank in at])

    def _subtree(self, max_depth: int, max_width: int | None) -> StaticTree:
        """The tree's nodes at most ``max_depth`` deep, each node's first ``max_width`` children only (``limit_width``'s rule)."""
        key = (min(max_depth, self.tree.depth), min(max_width or self.tree.width, self.tree.width))
        if key == (self.tree.depth, self.tree.width):
            return self.tree
        if key not in self._subtrees:
            depth, width = key
            kept: dict[RankPath, int] = {(): 0}  # kept path -> its kept children so far
            for path in self.tree.paths:  # depth first, then rank: a node's children in draft order
                parent = path[:-1]
                if len(path) <= depth and parent in kept and kept[parent] < width:
                    kept[parent] += 1
                    kept[path] = 0
            self._subtrees[key] = static_tree([p for p in kept if p], max_depth=depth, what="medusa tree")
        return self._subtrees[key]

    def export(self, out_dir: str | Path, format: str = "vllm") -> EngineExport:
        """Write the heads in vLLM's Medusa layout (their native one) into ``out_dir``, checked tensor by tensor.

        The calibration goes with them: engines ignore it, draftsmith grows the same tree from it.
        """
        check_format(format, ("vllm",), "medusa")

        def write(directory: Path) -> None:
            self.heads.save(directory)
            if self.calibration is not None:
                (directory / CALIBRATION).write_text(json.dumps(self.calibration, indent=1) + "\n")

        path = write_export(out_dir, write, self.heads.state_dict(), self.heads.config())
        spec = {"method": "medusa", "model": str(path), "num_speculative_tokens": self.heads.num_heads}
        return write_spec(EngineExport(path, format, spec))


def _last_state(features: TargetFeatures | None, device: torch.device) -> torch.Tensor:
    if features is None or -1 not in features.hidden_states:
        raise ValueError("the Medusa proposer needs the target's final hidden state (hidden_layers=(-1,)) with every observe")
    return features.hidden_states[-1][-1].float().to(device)  # [hidden], on the heads' device


def _choose_tree(tree, calibration: dict | None, max_nodes: int | None, num_heads: int) -> StaticTree:
    if tree is not None:
        chosen = static_tree(tree, max_depth=num_heads, what="medusa tree")
        if max_nodes is not None and max_nodes < chosen.num_nodes:
            chosen = static_tree(chosen.paths[:max_nodes], max_depth=num_heads, what="medusa tree")
        return chosen
    if calibration is None:
        raise InputError(
            "these Medusa heads have no calibration.json (it is written when they are trained here): give the tree as rank paths, "
            "tree: [[0], [1], [0, 0], ...] (medusa_choices)"
        )
    budget = max_nodes if max_nodes is not None else calibration.get("max_nodes", DEFAULT_MAX_NODES)
    grown = grow_calibrated_tree(calibration, budget, num_heads)
    if not grown:
        warnings.warn("the calibration says no head guess was ever right: drafting one node per step", stacklevel=3)
        grown = [(0,)]
    return static_tree(grown, max_depth=num_heads, what="calibrated medusa tree")
