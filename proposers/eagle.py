"""EAGLE: one small decoder layer drafts at the feature level, fed with the target's own hidden states.

- EAGLE-1 (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty"): the layer's input is ``fc(concat(embed(next token), feature))``, the
  feature being the target's final normed state; the layer's output predicts the next
  feature, and the target's own LM head turns it into a distribution. Embedding and LM
  head are the target's, frozen and never saved.
- EAGLE-2 (Li et al. 2024): the dynamic tree of ``proposers.core.dynamic_tree.grow_dynamic_tree``
  (``tree_width > 1``, ``max_nodes``), one draft forward per depth with tree attention
  over the draft's own cache.
- EAGLE-3 (Li et al. 2025): the feature fuses three target layers (low / mid / high,
  ``aux_layers`` in ``output_hidden_states`` numbering) through ``fc``; the layer reads
  ``concat(norm(embed(token)), norm(feature))`` (q / k / v of twice the hidden width);
  after the first step it feeds back its own output; its own LM head scores a reduced
  draft vocabulary, mapped to target ids by ``d2t`` (target id = draft id + d2t[draft id]).
- P-EAGLE (parallel drafting): a head trained with ``parallel: true`` (``parallel_depth`` in
  its config) drafts all depths in one forward: the catch-up entries, then ``k - 1`` mask
  entries (``EagleDraft.mask_inputs``) in the same causal step; depth d's logits are the
  row d - 1 after the last catch-up entry. A chain, or a tree of each depth's top tokens
  combined best first (``proposers.core.block``), as every drafter of all depths at once.

Alignment: the draft entry at position i reads the target's feature of position i and
the token at i + 1, and predicts the token at i + 2. After a verification the draft has
entries up to the position before the root (the last committed token); the entry for
(root, feature of the position before it) gives the tree's first level, and each node
feeds the output of its parent's entry. Tree entries are dropped after verification: the
accepted ones are fed again with the target's own features.

The head itself (config, layer, checkpoints) is ``proposers.eagle_head``.

Lossless at every temperature: a sampled tree carries the distributions its tokens were
drawn from (over target ids: tokens outside the draft vocabulary have probability 0), a
deterministic one point masses.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .core.block import position_draft
from .core.cache import CACHE_HEADROOM, PreallocatedLayer
from .core.devices import check_shared_device, host_lists, reads_are_free
from .core.dynamic_tree import DraftTree, grow_dynamic_tree
from .core.engine import EngineExport, ExportControl, check_format, incomplete_copy, write_export, write_spec
from .core.errors import InputError, check_integer, check_probability
from .core.features import FeatureQueue
from .core.proposer import ProposerBase
from .core.sampling import draw_rows, logits_to_probs
from .core.tree import incremental_tree_mask
from .core.types import Draft, ProposeContext, TargetFeatures, VerifyResult
from .eagle_head import EagleDraft, check_head_fits, checkpoint_config, load_draft

# -- the proposer ------------------------------------------------------------------------


class EagleProposer(ProposerBase):
    """Draft with an EAGLE head: a chain (EAGLE-1), or EAGLE-2's dynamic tree.

    Args:
        model: an ``EagleDraft``, or a directory holding one (``EagleDraft.save``).
        target: the target model (required: the draft shares its embedding, and for EAGLE-1 its LM head).
        k: draft depth (default 5; a parallel head's: the depth it trained for).
        tree_width: 1 drafts a chain; w > 1 grows EAGLE-2's dynamic tree: every expanded
            node gets w children, the w best leaves by cumulative draft log-prob are expanded.
        max_nodes: node budget of the tree (at least ``k``; default: no limit beyond width and depth).
        sample: at temperature > 0, sample the tree from the draft's processed distribution
            (``draft_probs`` given); False drafts deterministic top-k trees (point masses) at every temperature.
        confidence_threshold: stop extending a branch after a token whose draft probability is below this.
        min_path_prob: drop (deterministic trees) and never expand nodes whose path probability
            is below this (``grow_dynamic_tree``): each node costs a row of the target's forward.

    A parallel (P-EAGLE) head drafts ``k`` (at most the depth it trained for) depths in one
    forward; its trees combine each depth's top ``tree_width`` tokens up to ``max_nodes``
    (default ``k * tree_width``), and the two dynamic-tree keys above do not apply to it.
    """

    def __init__(
        self,
        model: EagleDraft | str | Path,
        target: nn.Module | None = None,
        k: int | None = None,
        tree_width: int = 1,
        max_nodes: int | None = None,
        sample: bool = True,
        confidence_threshold: float | None = None,
        min_path_prob: float | None = None,
    ):
        if target is None:
            raise InputError("the EAGLE proposer needs the target model: its draft shares the target's embedding and reads its features")
        if isinstance(model, (str, Path)):
            model = load_draft(model, target)
        else:
            check_head_fits(model.cfg, target)
        k = (model.cfg.parallel_depth or 5) if k is None else k
        for name, value in (("k", k), ("tree_width", tree_width)):
            if check_integer(name, value) < 1:
                raise InputError(f"{name} must be >= 1, got {value}")
        if max_nodes is not None and check_integer("max_nodes", max_nodes) < k:
            raise InputError(
                f"max_nodes must be at least the depth k={k} (a budget below the depth cannot hold one full chain), got {max_nodes}"
            )
        check_probability("confidence_threshold", confidence_threshold)
        check_probability("min_path_prob", min_path_prob)
        if model.cfg.parallel_depth:
            if k > model.cfg.parallel_depth:
                raise InputError(
                    f"k={k}: this parallel (P-EAGLE) head was trained to draft {model.cfg.parallel_depth} depths in one forward; "
                    f"give k <= {model.cfg.parallel_depth}"
                )
            if confidence_threshold is not None or min_path_prob is not None:
                raise InputError(
                    "confidence_threshold and min_path_prob shape EAGLE-2's dynamic trees: a parallel head drafts every depth at once"
                )
        self.draft = model.eval()
        self.cfg = model.cfg
        self.vocab_size = model.cfg.vocab_size
        self.hidden_layers = tuple(model.cfg.aux_layers)
        self.k, self.tree_width, self.max_nodes, self.sample = k, tree_width, max_nodes, sample
        self.confidence_threshold, self.min_path_prob = confidence_threshold, min_path_prob
        self.device = model.fc.weight.device
        check_shared_device("EAGLE head", self.device, model.shared)
        ids = model.draft_to_target() if model.cfg.version == 3 else None
        # draft logits need a scatter onto target ids only where the draft vocabulary is not the target's in order
        self._draft_ids = None if ids is None or torch.equal(ids, torch.arange(self.vocab_size, device=ids.device)) else ids
        self.cache: PreallocatedLayer | None = None
        self._features = FeatureQueue(self.hidden_layers, "EAGLE")  # the positions not yet fed
        self._fed = 0  # draft entries fed with the target's own features (positions 0 .. fed - 1)

    def draft_depth(self) -> int:
        return self.k

    def draft_width(self) -> int:
        return self.tree_width

    def export(self, out_dir: str | Path, format: str = "vllm") -> EngineExport:
        """Write the head in the layout vLLM and SGLang load (its native one), checked tensor by tensor and field by field.

        EAGLE-3's aux layer ids are written in transformers' ``output_hidden_states``
        numbering, which is vLLM's (id i = the hidden state entering layer i); both
        ``eagle_config.eagle_aux_hidden_state_layer_ids`` and the top-level field are
        written. An engine that shifts ids by one when the first is 1 would read such a
        list differently, so a first id below 2 is refused.
        """
        cfg = self.cfg
        check_format(
            format, ("vllm",) if cfg.parallel_depth else ("vllm", "sglang"), "a parallel eagle head" if cfg.parallel_depth else "eagle"
        )
        if cfg.version == 3 and cfg.aux_layers[0] < 2:
            raise InputError(f"aux_layers {list(cfg.aux_layers)} start below 2: engines disagree on what id 1 means; retrain with ids >= 2")
        tensors = self.draft.tensors()
        if cfg.version == 3 and cfg.draft_vocab_size < cfg.vocab_size and "d2t" not in tensors:
            raise InputError("a reduced draft vocabulary needs its d2t map: the head has none")
        path = write_export(out_dir, self.draft.save, tensors, checkpoint_config(cfg))
        width_nodes = self.max_nodes or self.k * self.tree_width
        if format == "sglang":
            spec = {
                "speculative-algorithm": "EAGLE3" if cfg.version == 3 else "EAGLE",
                "speculative-draft-model-path": str(path),
                "speculative-num-steps": self.k,
                "speculative-eagle-topk": self.tree_width,
                "speculative-num-draft-tokens": width_nodes + 1,
            }
        else:
            spec = {"method": "eagle3" if cfg.version == 3 else "eagle", "model": str(path), "num_speculative_tokens": self.k}
            if cfg.parallel_depth:  # vLLM's P-EAGLE: the mask slots embed config.json's mask_token_id and read mask_hidden
                spec["parallel_drafting"] = True
        return write_spec(EngineExport(path, format, spec))

    def export_controls(self, export: EngineExport, work: Path) -> list[ExportControl]:
        """EAGLE-3's incomplete exports, which an engine loads without a word (``export`` refuses both).

        - without ``d2t``, when it maps a reduced vocabulary (all-zero offsets are the identity an
          engine assumes anyway): the draft ids land on the wrong target tokens, so the engine
          must accept near nothing;
        - without the aux-layer-id fields, when they are not the engine's default
          (``[2, N // 2, N - 3]``): it feeds the head other layers than it trained on; how much
          that costs depends on how alike those layers are, so the gain is only reported;
        - a parallel head served without ``parallel_drafting``: the engine drafts depth by
          depth, feeding the head its own outputs where it trained on mask entries (reported).
        """
        cfg = self.cfg
        if cfg.version != 3:
            return []
        controls = []
        if bool(self.draft.d2t.any()):
            controls.append(ExportControl("no d2t", incomplete_copy(export, work / f"{export.path.name}-no-d2t", drop="d2t"), True))
        layers = cfg.target_num_layers
        if list(cfg.aux_layers) != [2, layers // 2, layers - 3]:

            def without_ids(config: dict) -> dict:
                config.pop("eagle_aux_hidden_state_layer_ids")
                config["eagle_config"] = {k: v for k, v in config["eagle_config"].items() if k != "eagle_aux_hidden_state_layer_ids"}
                return config

            copy = incomplete_copy(export, work / f"{export.path.name}-no-aux-ids", edit_config=without_ids)
            controls.append(ExportControl("no aux ids", copy, False))
        if cfg.parallel_depth:  # served without parallel_drafting, the engine feeds depths 2 .. its own outputs, never trained on
            copy = incomplete_copy(export, work / f"{export.path.name}-sequential")
            spec = {k: v for k, v in copy.speculative_config.items() if k != "parallel_drafting"}
            controls.append(ExportControl("served sequentially", EngineExport(copy.path, copy.format, spec), False))
        return controls

    def begin(self, prompt: list[int], features: TargetFeatures | None) -> None:
        self.cache = PreallocatedLayer(len(prompt) + CACHE_HEADROOM)
        self._fed = 0
        self._features.start(features)

    def observe(self, result: VerifyResult, features: TargetFeatures | None) -> None:
        self._features.push(features)

    @torch.inference_mode()
    def propose(self, context: ProposeContext) -> Draft:
        if self.cache is None:
            raise ValueError("propose() before begin(): the EAGLE proposer needs the prompt's features")
        self.cache.truncate(self._fed)  # drop the last step's tree entries (fed with draft features)
        depth, width = min(self.k, context.max_depth), min(self.tree_width, context.max_width or self.tree_width)
        if self.cfg.parallel_depth:  # every depth in the catch-up's own forward
            _, logits = self._catch_up(context.tokens, masks=max(depth - 1, 0))
            return position_draft(logits, context, self.tree_width, self.max_nodes, self.sample) if depth >= 1 else Draft.empty()
        root_hidden, root_logits = self._catch_up(context.tokens)
        root_hidden, root_logits = root_hidden[0], root_logits[0]
        if depth < 1:
            return Draft.empty()
        committed = self.cache.length  # entries up to the one before the root
        if width == 1 and self.confidence_threshold is None and self.min_path_prob is None and not reads_are_free(self.device):
            return self._chain_on_device(root_hidden, root_logits, depth, committed, context)
        outputs: dict[int, torch.Tensor] = {-1: root_hidden}
        fed: list[int] = []

        def score(tree: DraftTree, nodes: list[int]) -> torch.Tensor:
            tokens = torch.tensor([[tree.tokens[n] for n in nodes]], device=self.device)
            hidden = torch.stack([outputs[tree.parents[n]] for n in nodes])[None]
            positions = [committed - 1 + tree.depths[n] for n in nodes]
            mask = None
            if width > 1:
                mask = incremental_tree_mask(tree.parents, fed, nodes, committed, hidden.dtype, self.device)
            out = self.draft.step(tokens, hidden, positions, self.cache, mask)[0]  # [len(nodes), hidden]
            fed.extend(nodes)
            outputs.update(zip(nodes, out, strict=True))
            return self._target_logits(out)

        grown = grow_dynamic_tree(
            root_logits,
            score,
            depth,
            width,
            context.sampling,
            sampled=self.sample and not context.sampling.greedy,
            max_nodes=self.max_nodes,
            confidence_threshold=self.confidence_threshold,
            generator=context.generator_for(self.device),
            min_path_prob=self.min_path_prob,
            stop=context.stop,
        )
        return grown.draft

    def _chain_on_device(self, hidden: torch.Tensor, logits: torch.Tensor, depth: int, committed: int, context: ProposeContext) -> Draft:
        """The chain ``grow_dynamic_tree`` grows at width 1 (each depth's top token, or a draw), kept on the head's device
        and read by the host once: a chain of fixed depth has no decision to take between its depths."""
        sampled = self.sample and not context.sampling.greedy
        tokens, scores, rows = [], [], []
        for d in range(1, depth + 1):
            if sampled:
                probs = logits_to_probs(logits, context.sampling, check=False)
                token = draw_rows(probs[None], context.generator_for(self.device))  # [1]
                score = probs[token]
                rows.append(probs)
            else:
                score, token = logits.softmax(-1).max(-1, keepdim=True)  # the raw softmax's confidence, as the tree builder's
            tokens.append(token)
            scores.append(score)
            if d < depth:  # the node's entry, after its parent's: the next depth's logits
                hidden = self.draft.step(token[None], hidden[None, None], [committed - 1 + d], self.cache, None)[0, 0]
                logits = self._target_logits(hidden[None])[0]
        tokens, scores = host_lists(torch.cat(tokens), torch.cat(scores))  # one read
        return Draft.chain(tokens, torch.stack(rows) if rows else None, scores=scores)

    def _catch_up(self, tokens: list[int], masks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every position whose feature is known (the last is the one before the root), then ``masks`` mask entries
        (a parallel head's depths 2 ..), which leave the cache again; return the outputs ``[1 + masks, hidden]`` from the
        last fed position on, and their logits."""
        features = self._features.pop(self.device)  # [rows, feature width]: the aux layers side by side (EAGLE-3)
        start, rows = self._fed, features.shape[0]
        assert start + rows == len(tokens) - 1, f"{rows} new features after {start} entries for {len(tokens)} tokens"
        ids = torch.tensor([tokens[start + 1 : start + 1 + rows]], device=self.device)
        hidden = self.draft.fuse(features)[None]  # [1, rows, hidden]
        if masks:
            mask_ids, mask_hidden = self.draft.mask_inputs(masks)
            ids, hidden = torch.cat([ids, mask_ids], dim=1), torch.cat([hidden, mask_hidden], dim=1)
        positions = range(start, start + rows + masks)
        out = self.draft.step(ids, hidden, positions, self.cache, None)[0, rows - 1 :]
        self._fed = start + rows
        self.cache.truncate(self._fed)
        return out, self._target_logits(out)

    def _target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over target ids ``[rows, vocab]`` (-inf outside a reduced draft vocabulary), float, on the head's device
        (the tree builder reads only each row's top tokens from it)."""
        logits = self.draft.logits(hidden).float()
        if self._draft_ids is None:
            return logits
        full = torch.full((logits.shape[0], self.vocab_size), float("-inf"), device=logits.device)
        full[:, self._draft_ids] = logits
        return full
