"""DFlash: a block drafter fills every depth of a draft in one forward (Chen et al. 2026).

The drafter (``proposers.dflash_head``) reads the target's hidden states of several layers
at every committed position before the anchor, as keys and values of its own layers, and
fills a block of the anchor (the last committed token) and ``block_size - 1`` mask
positions in one non-causal forward: position d of the block guesses the token d places
after the anchor. One forward per step, whatever the depth, where EAGLE and MTP run one
per depth.

Alignment: after a verification the target has scored every committed position but the
last (the recovered or bonus token, the next anchor); ``observe`` queues those positions'
features and the next ``propose`` feeds them into the drafter's per-layer context cache
before it runs the block, so a request planned plain by the speculation controller pays
nothing but the queue. The block's own keys are dropped from the cache after each step.

Drafts: a chain of the block's top tokens (at T > 0 sampled from each position's processed
distribution, with those rows as ``draft_probs``), or a tree of each position's top tokens
combined best first (``proposers.core.block``); exact at every temperature.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from .core.block import position_draft
from .core.cache import CACHE_HEADROOM, PreallocatedLayer
from .core.devices import check_shared_device
from .core.engine import EngineExport, ExportControl, check_format, incomplete_copy, write_export, write_spec
from .core.errors import InputError, check_integer
from .core.features import FeatureQueue
from .core.proposer import ProposerBase
from .core.types import Draft, ProposeContext, TargetFeatures, VerifyResult
from .dflash_head import MASK_EMBEDDING, DFlashDraft, check_dflash_fits, checkpoint_config, load_dflash, read_mask_embedding


class DFlashProposer(ProposerBase):
    """Draft with a DFlash block drafter: a chain of up to ``block_size - 1`` tokens, or a tree of each position's top tokens.

    Args:
        model: a ``DFlashDraft``, or a directory holding one (``DFlashDraft.save``).
        target: the target model (required: the drafter shares its embedding and LM head).
        k: draft depth, at most the block's ``block_size - 1`` guesses (default: all of them).
        tree_width: 1 drafts a chain; w > 1 a tree of each position's top-w tokens.
        max_nodes: a tree's node budget (default ``k * tree_width``).
        sample: at temperature > 0 a chain's tokens are drawn from the drafter's distribution
            (False: its top tokens as point masses; trees are always point masses).
    """

    def __init__(
        self,
        model: DFlashDraft | str | Path,
        target: nn.Module | None = None,
        k: int | None = None,
        tree_width: int = 1,
        max_nodes: int | None = None,
        sample: bool = True,
    ):
        if target is None:
            raise InputError("the DFlash proposer needs the target model: its drafter shares the target's embedding and LM head")
        if isinstance(model, (str, Path)):
            model = load_dflash(model, target)
        else:
            check_dflash_fits(model.cfg, target)
        guesses = model.cfg.block_size - 1
        k = guesses if k is None else k
        if not 1 <= check_integer("k", k) <= guesses:
            raise InputError(
                f"k must be in [1, {guesses}]: this drafter was trained on blocks of {model.cfg.block_size} "
                f"(the anchor and {guesses} guesses), got {k}"
            )
        if check_integer("tree_width", tree_width) < 1:
            raise InputError(f"tree_width must be >= 1, got {tree_width}")
        if max_nodes is not None and check_integer("max_nodes", max_nodes) < k:
            raise InputError(
                f"max_nodes must be at least the depth k={k} (a budget below the depth cannot hold one full chain), got {max_nodes}"
            )
        self.draft, self.cfg = model.eval(), model.cfg
        self.vocab_size = model.cfg.vocab_size
        self.hidden_layers = tuple(model.cfg.aux_layers)
        self.k, self.tree_width, self.max_nodes, self.sample = k, tree_width, max_nodes, sample
        self.device = model.fc.weight.device
        check_shared_device("DFlash drafter", self.device, model.shared)
        self.caches: list[PreallocatedLayer] = []
        self._features = FeatureQueue(self.hidden_layers, "DFlash")  # the positions not yet in the context caches
        self._fed = 0  # context positions in the caches

    def draft_depth(self) -> int:
        return self.k

    def draft_width(self) -> int:
        return self.tree_width

    def begin(self, prompt: list[int], features: TargetFeatures | None) -> None:
        self.caches = [PreallocatedLayer(len(prompt) + CACHE_HEADROOM) for _ in self.draft.layers]
        self._fed = 0
        self._features.start(features)

    def observe(self, result: VerifyResult, features: TargetFeatures | None) -> None:
        self._features.push(features)

    @torch.inference_mode()
    def propose(self, context: ProposeContext) -> Draft:
        if not self.caches:
            raise ValueError("propose() before begin(): the DFlash proposer needs the prompt's features")
        depth = min(self.k, context.max_depth)
        self._catch_up(len(context.tokens) - 1)
        if depth < 1:
            return Draft.empty()
        anchor = len(context.tokens) - 1
        hidden = self.draft.block_inputs(torch.tensor([[context.tokens[-1]]], device=self.device))  # [1, block, hidden]
        cos, sin = self.draft.rotary(range(anchor, anchor + self.cfg.block_size))
        for layer, cache in zip(self.draft.layers, self.caches, strict=True):
            hidden = layer(hidden, cos, sin, cache, None)
            cache.truncate(self._fed)  # the block's own keys go
        logits = self.draft.logits(hidden[0, 1 : 1 + depth]).float()  # [depth, vocab], on the drafter's device
        return position_draft(logits, context, self.tree_width, self.max_nodes, self.sample)

    def _catch_up(self, positions: int) -> None:
        """Feed the queued features into every layer's context cache: it then holds ``positions`` positions (all before the anchor)."""
        features = self._features.pop(self.device)  # [rows, n_aux * hidden]
        start, rows = self._fed, features.shape[0]
        assert start + rows == positions, f"{rows} new features after {start} positions for an anchor at {positions}"
        rows_context = self.draft.context(features)[None]  # [1, rows, hidden]
        cos, sin = self.draft.rotary(range(start, positions))
        for layer, cache in zip(self.draft.layers, self.caches, strict=True):
            cache.update(*layer.context_kv(rows_context, cos, sin))
        self._fed = positions

    def export(self, out_dir: str | Path, format: str = "vllm") -> EngineExport:
        """Write the drafter in the layout vLLM's ``DFlashDraftModel`` loads, checked tensor by tensor and field by field.

        vLLM runs a block of one anchor and ``num_speculative_tokens`` mask positions, so the
        export asks for ``block_size - 1``: the block the drafter trained on (a shorter one
        would change what every position attends to). A proposer drafting fewer is warned.
        """
        check_format(format, ("vllm",), "dflash")
        draft, guesses = self.draft, self.cfg.block_size - 1
        if self.k != guesses:
            warnings.warn(
                f"k={self.k}: vLLM drafts one block of the anchor and num_speculative_tokens masks, so the export asks for the "
                f"{guesses} this drafter trained on; its acceptance compares with draftsmith's at k={guesses}",
                stacklevel=2,
            )

        def write(directory: Path) -> None:
            draft.save(directory)
            if not torch.equal(read_mask_embedding(directory, draft.cfg), draft.mask_embedding.detach().cpu()):
                raise InputError(f"exported {directory / MASK_EMBEDDING} differs from the trained mask embedding")

        fields = {k: v for k, v in checkpoint_config(self.cfg).items() if k in ("dflash_config", "num_hidden_layers", "target_hidden_size")}
        path = write_export(out_dir, write, draft.tensors(), fields)
        spec = {"method": "dflash", "model": str(path), "num_speculative_tokens": guesses}
        return write_spec(EngineExport(path, format, spec))

    def export_controls(self, export: EngineExport, work: Path) -> list[ExportControl]:
        """Incomplete copies an engine loads without a word: no mask embedding file (the mask positions then read the
        vocabulary's embedding of ``mask_token_id``, not what the drafter trained on), and, when the drafter reads as many
        target layers as it has layers of its own, no ``target_layer_ids`` (vLLM then hands over as many layers of its
        own choice; with another count its ``fc`` does not fit and it refuses loudly). How much each costs depends on the
        model: reported."""
        no_mask = incomplete_copy(export, work / f"{export.path.name}-no-mask-embedding")
        (no_mask.path / MASK_EMBEDDING).unlink()
        controls = [ExportControl("no mask embedding", no_mask, False)]
        if len(self.cfg.aux_layers) == self.cfg.num_layers:

            def without_layer_ids(config: dict) -> dict:
                config["dflash_config"] = {k: v for k, v in config["dflash_config"].items() if k != "target_layer_ids"}
                return config

            no_ids = incomplete_copy(export, work / f"{export.path.name}-no-layer-ids", edit_config=without_layer_ids)
            controls.append(ExportControl("no layer ids", no_ids, False))
        return controls
