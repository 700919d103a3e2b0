"""A separate small causal LM drafts the next tokens: a chain, or a tree scored level by level.

Speculative decoding as in Leviathan et al. 2023 and Chen et al. 2023. The tree is the
shared dynamic tree of ``proposers.core.tree`` (EAGLE-2, Li et al. 2024), one draft forward per
depth through the incremental tree mask. What is specific to a draft LM lives here:
loading and vocabulary checks, its own KV cache (after every verification it drops the
rejected guesses and keeps the accepted ones, so the next draft starts after one new
token), the lean forward through the draft's own submodules (``lean_forward``), and the
dynamic draft depth.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from .core.cache import CACHE_HEADROOM, compact_cache, crop_cache, make_cache
from .core.dynamic_tree import DraftTree, grow_dynamic_tree
from .core.engine import EngineExport, check_format, write_export, write_spec
from .core.errors import InputError, check_probability
from .core.lean_forward import LEAN_MAX_ROWS, fast_paths, forward_mode
from .core.models import (
    TOKENIZER_FILES,
    check_full_attention,
    context_limit,
    load_causal_lm,
    load_tokenizer,
    output_vocab_size,
    saved_tensors,
)
from .core.proposer import ProposerBase
from .core.tree import incremental_tree_mask
from .core.types import Draft, ProposeContext, TargetFeatures, TransformersPeer, VerifyResult

SAMPLED_TOKEN_IDS = 4096  # token strings compared between draft and target tokenizers


class DraftModelProposer(ProposerBase):
    """Draft with a small causal LM that shares the target's vocabulary.

    Args:
        model: an ``nn.Module`` causal LM, or a local checkpoint directory.
        k: draft depth (tokens per chain); the starting depth when ``dynamic``.
        tree_width: 1 drafts a chain; w > 1 gives every expanded node w children and
            expands the w best leaves (by cumulative draft log-prob) at each depth.
        max_nodes: node budget (default: no limit beyond width and depth). A greedy tree
            is grown in full and cut to the best nodes; a sampled one stops drawing at
            the budget (``grow_dynamic_tree``).
        dynamic: grow the depth by 1 after a fully accepted draft, shrink it by 1 after a
            rejection, within ``[k_min, k_max]``; reset to ``k`` by ``begin``.
        k_min, k_max: bounds of the dynamic depth.
        confidence_threshold: stop extending a branch after a token whose draft
            probability is below this (None: always draft the full depth).
        min_path_prob: drop (greedy trees) and never expand nodes whose path probability
            is below this (``grow_dynamic_tree``): each node costs a row of the target's forward.
        target: the target model; when given, the vocabularies are checked against it.
        lean_forward: call the draft's submodules directly during drafting when a probe
            shows that this gives its own forward's logits (``proposers.core.lean_forward``);
            False always calls ``model(...)``; None: on unless the environment sets
            ``DRAFTSMITH_FAST_PATHS=0``. Either way the draft probabilities are the
            ones the tokens were drawn from, so the choice never changes what is lossless.
        preallocated_cache: keep the draft's KV cache in buffers written in place
            (``proposers.core.cache``) when a probe shows its logits unchanged; None: on unless
            the environment sets ``DRAFTSMITH_FAST_PATHS=0``.
        compile: run the lean forward through ``torch.compile`` (off by default: the first
            drafts compile for seconds; ``LeanForward.compiled``). Needs the lean forward
            and the preallocated cache; without them it is ignored with a logged reason.

    The cache keeps the KV of the accepted draft tokens that were fed to draft (``observe``
    drops the rest), so the next step feeds only the target's recovered or bonus token.

    Context limit: the draft drafts only while the committed tokens plus the draft fit its
    own positions (``max_position_embeddings``, or ``n_positions``; ``context_limit``):
    the depth shrinks to the room left, and once no room is left ``propose`` returns an
    empty draft and decoding continues plain, one target token per step, with the same
    output. A draft with fewer positions than the target is never run past them (RoPE
    models would run on silently, learned-position models would crash).

    Sliding-window drafts are refused (``check_full_attention``): their cache evicts
    the oldest entries to make room for guesses, so rejected guesses cannot be dropped.
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self,
        model: nn.Module | str | Path,
        k: int = 4,
        tree_width: int = 1,
        max_nodes: int | None = None,
        dynamic: bool = False,
        k_min: int = 1,
        k_max: int = 8,
        confidence_threshold: float | None = None,
        min_path_prob: float | None = None,
        target: nn.Module | None = None,
        lean_forward: bool | None = None,
        preallocated_cache: bool | None = None,
        compile: bool = False,
    ):
        _check_settings(k, tree_width, max_nodes, dynamic, k_min, k_max, confidence_threshold, min_path_prob)
        if isinstance(model, (str, Path)):
            model = load_draft_model(model, device=target.device if target is not None else None)
        check_full_attention(model, "draft")
        self.model = model.eval()
        self.device = model.device  # read once: the property walks the parameters
        self.vocab_size = output_vocab_size(model)
        self.max_positions = context_limit(model)  # None: no limit stated
        if target is not None:
            check_vocabulary(model, target)
            warn_if_bigger(model, target)
        self.k, self.tree_width, self.max_nodes = k, tree_width, max_nodes
        self.dynamic, self.k_min, self.k_max = dynamic, k_min, k_max
        self.confidence_threshold, self.min_path_prob = confidence_threshold, min_path_prob
        paths = fast_paths(self.model, "draft", preallocated_cache, lean_forward, compile)
        self.preallocate, self.lean, self.compiled, self.forward = paths.preallocate, paths.lean, paths.compiled, paths.forward
        self.depth = k  # the current draft depth; moves only when dynamic
        self.cache: DynamicCache | None = None
        self.cached_tokens: list[int] = []  # tokens whose KV the cache holds, in order (committed or a chain's guesses)
        self._last_depth = 0
        self._pending: tuple[int, list[int]] | None = None  # (committed tokens, tree node of each draft node) of the last propose
        self._width = tree_width  # this step's tree width (the controller may ask for a chain)
        self._fed: list[int] = []  # tree nodes fed into the cache after the committed tokens, in cache order

    def draft_depth(self) -> int:
        return self.k_max if self.dynamic else self.k

    def draft_width(self) -> int:
        return self.tree_width

    def transformers_peer(self) -> TransformersPeer:
        """transformers' assisted generation with the same draft model."""
        return TransformersPeer("hf_assisted", {"assistant_model": self.model})

    def export(self, out_dir: str | Path, format: str = "vllm") -> EngineExport:
        """The draft model's ``save_pretrained`` directory for vLLM's ``draft_model`` method, checked tensor by tensor.

        vLLM drafts a chain of ``k`` tokens every step: a tree, a dynamic depth or a
        confidence threshold here is not part of the export (a warning says so).
        """
        check_format(format, ("vllm",), "draft_model")
        if self.tree_width > 1 or self.dynamic or self.confidence_threshold is not None or self.min_path_prob is not None:
            warnings.warn(
                f"vLLM's draft_model method drafts a {self.k}-token chain every step; tree_width, dynamic, "
                "confidence_threshold and min_path_prob are not exported",
                stacklevel=2,
            )
        config = self.model.config
        fields = {"vocab_size": config.vocab_size, "model_type": config.model_type}
        path = write_export(out_dir, lambda d: self.model.save_pretrained(d), saved_tensors(self.model), fields)
        return write_spec(EngineExport(path, format, {"method": "draft_model", "model": str(path), "num_speculative_tokens": self.k}))

    @property
    def cache_len(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def begin(self, prompt: list[int], features: TargetFeatures | None) -> None:
        """Start an empty draft cache and reset the dynamic depth; the prompt is fed at the first ``propose``.

        Lazily: a request that never drafts (the controller may plan every step plain)
        never pays the draft's prefill. The depth restarts at ``k`` so that a seeded
        request gives the same output whatever ran before it.
        """
        with forward_mode(self.compiled):
            self._begin(prompt)

    def _begin(self, prompt: list[int]) -> None:
        self.cache = self._new_cache(len(prompt))
        self.cached_tokens = []
        self.depth, self._last_depth, self._pending = self.k, 0, None

    def propose(self, context: ProposeContext) -> Draft:
        """Catch the cache up with ``context.tokens`` and draft.

        The nodes fed to draft stay in the cache until ``observe`` keeps the accepted ones
        (a chain's already sit at their final positions; a tree's are compacted).
        """
        with forward_mode(self.compiled):
            return self._propose(context)

    def _propose(self, context: ProposeContext) -> Draft:
        assert context.tokens, "propose() needs at least one committed token"
        depth = min(self.depth, context.max_depth, self._room(len(context.tokens)))
        if depth < 1:
            return Draft.empty()
        committed = len(context.tokens)
        root_logits = self._catch_up(context.tokens)
        self._fed, self._width = [], min(self.tree_width, context.max_width or self.tree_width)
        try:
            grown = grow_dynamic_tree(
                root_logits,
                self._score_nodes,
                depth,
                self._width,
                context.sampling,
                sampled=not context.sampling.greedy,
                max_nodes=self.max_nodes,
                confidence_threshold=self.confidence_threshold,
                generator=context.generator_for(self.device),
                min_path_prob=self.min_path_prob,
                stop=context.stop,
            )
        except BaseException:
            self._crop(committed)
            raise
        self._last_depth = grown.depth
        self._pending = (committed, grown.tree_nodes)
        return grown.draft

    def observe(self, result: VerifyResult, features: TargetFeatures | None) -> None:
        """Drop the KV of rejected guesses; adapt the draft depth (when dynamic).

        The committed tokens themselves catch up lazily in ``propose``.
        """
        if self._pending is not None:
            committed, tree_nodes = self._pending
            self._pending = None
            with forward_mode(self.compiled):  # the cache's tensors are written in the mode they were made in
                if self._width == 1:
                    self._crop(committed + result.num_accepted)
                else:
                    self._keep_accepted(committed, [tree_nodes[i] for i in result.accepted_nodes], result.accepted_tokens)
        drafted, self._last_depth = self._last_depth, 0
        if not self.dynamic or drafted == 0:
            return
        if result.recovered:
            self.depth = max(self.k_min, self.depth - 1)
        elif drafted == self.depth and result.num_accepted == drafted:
            self.depth = min(self.k_max, self.depth + 1)

    def _room(self, committed: int) -> int:
        """How many draft tokens fit the draft's positions after ``committed`` tokens."""
        return self.max_positions - committed if self.max_positions is not None else sys.maxsize

    # -- the draft cache -------------------------------------------------------------

    def _new_cache(self, context: int) -> DynamicCache:
        """An empty cache; preallocated for the context plus room to generate (it grows beyond)."""
        return make_cache(self.model, context + CACHE_HEADROOM if self.preallocate else 0)

    def _catch_up(self, tokens: list[int]) -> torch.Tensor:
        """Feed the committed tokens the cache has not seen; return the logits after the last, ``[vocab]``."""
        if self.cache is None:  # propose() without begin(): start from an empty cache
            self.cache = self._new_cache(len(tokens))
        cached = self.cached_tokens
        limit = min(len(cached), len(tokens) - 1)  # the last token is always fed: we need its logits
        keep = limit if tokens[:limit] == cached[:limit] else 0  # the usual case: one C-speed comparison
        while keep < limit and cached[keep] == tokens[keep]:
            keep += 1
        self._crop(keep)
        return self._forward(tokens[keep:], last=1)[-1]

    def _forward(self, tokens: list[int], last: int = 0) -> torch.Tensor:
        """Run ``tokens`` (continuing ``cached_tokens``) through the draft, extending the cache.

        Returns float logits of the last ``last`` rows (0: all), ``[rows, vocab]``.
        """
        device = self.device
        input_ids = torch.tensor([tokens], device=device)
        if self.forward is not None and len(tokens) <= LEAN_MAX_ROWS:
            start = len(self.cached_tokens)
            positions = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)
            # an empty cache's buffers are allocated by its first write: compiled graphs run on allocated ones
            forward = self.forward if start else self.lean
            logits = forward(input_ids, self.cache, positions, last=last)
        else:
            logits = self.model(input_ids, cache=self.cache, use_cache=True, logits_to_keep=last).logits[0]
        self.cached_tokens.extend(tokens)
        return logits.float()  # on the draft's device: the tree builder reads only each row's top tokens

    def _crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions and their tokens."""
        crop_cache(self.cache, length)
        del self.cached_tokens[length:]

    def _keep_accepted(self, committed: int, path: list[int], tokens: list[int]) -> None:
        """Compact a tree's fed nodes to the accepted ones: ``path`` (tree nodes, root to leaf) and their ``tokens``.

        A fed node's ancestors were fed before it, so the fed part of the path is a prefix.
        """
        slot = {node: committed + i for i, node in enumerate(self._fed)}
        kept = list(itertools.takewhile(slot.__contains__, path))
        compact_cache(self.cache, committed, [slot[node] for node in kept])
        self.cached_tokens += tokens[: len(kept)]

    # -- drafting --------------------------------------------------------------------

    def _score_nodes(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        """Feed ``nodes`` (whose ancestors are cached) in one forward; return their logits ``[len(nodes), vocab]``."""
        if self._width == 1:  # a chain: the node continues the cached tokens
            return self._forward([tree.tokens[n] for n in nodes])
        device = self.device
        input_ids = torch.tensor([[tree.tokens[n] for n in nodes]], device=device)
        committed = len(self.cached_tokens)  # the cache holds them, then the tree nodes fed so far
        mask = incremental_tree_mask(tree.parents, self._fed, nodes, committed, self.model.dtype, device)
        position_ids = torch.tensor([[committed - 1 + tree.depths[n] for n in nodes]], device=device)
        self._fed += nodes
        if self.forward is not None:
            logits = self.forward(input_ids, self.cache, position_ids, mask)
        else:
            logits = self.model(input_ids, cache=self.cache, use_cache=True, attention_mask=mask, position_ids=position_ids).logits[0]
        return logits.float()


# -- construction checks -------------------------------------------------------------


def _check_settings(k, tree_width, max_nodes, dynamic, k_min, k_max, confidence_threshold, min_path_prob) -> None:
    if k < 1 or tree_width < 1:
        raise InputError(f"k and tree_width must be >= 1, got k={k}, tree_width={tree_width}")
    if max_nodes is not None and max_nodes < 1:
        raise InputError(f"max_nodes must be >= 1 or None, got {max_nodes}")
    if dynamic and not 1 <= k_min <= k <= k_max:
        raise InputError(f"dynamic depth needs 1 <= k_min <= k <= k_max, got k_min={k_min}, k={k}, k_max={k_max}")
    check_probability("confidence_threshold", confidence_threshold)
    check_probability("min_path_prob", min_path_prob)


def load_draft_model(path: str | Path, device: torch.device | None = None) -> nn.Module:
    """Load a causal LM checkpoint directory in float32 (on ``device`` when given).

    A broken ``config.json``, weights file or tokenizer file (when the directory holds one)
    is one ``InputError`` line naming the file.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"draft model directory {path} does not exist (no hub downloads: give a local checkpoint)")
    model = load_causal_lm(path, "draft", dtype=torch.float32)
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        load_tokenizer(path, "draft")  # checked here, so that a broken file fails at load time, not at first use
    return model.to(device) if device is not None else model


def check_vocabulary(draft: nn.Module, target: nn.Module) -> None:
    """Raise InputError unless draft and target score the same tokens.

    Compares logits sizes, then (when both checkpoint directories hold a tokenizer) the
    special tokens and the strings of a sample of token ids.
    """
    draft_size, target_size = output_vocab_size(draft), output_vocab_size(target)
    if draft_size != target_size:
        raise InputError(
            f"draft vocabulary size {draft_size} differs from the target's {target_size}: the draft model must use the target's tokenizer"
        )
    draft_tok, target_tok = _local_tokenizer(draft, "draft"), _local_tokenizer(target, "target")
    if draft_tok is None or target_tok is None:
        return
    if len(draft_tok) != len(target_tok):
        raise InputError(f"draft tokenizer has {len(draft_tok)} tokens, the target's {len(target_tok)}: the vocabularies differ")
    for role in ("bos_token", "eos_token", "unk_token"):
        mine, theirs = getattr(draft_tok, role, None), getattr(target_tok, role, None)
        if str(mine) != str(theirs):
            raise InputError(f"draft {role} is {mine!r} but the target's is {theirs!r}: the vocabularies differ")
    for i in _sample_ids(len(target_tok), draft_tok.all_special_ids + target_tok.all_special_ids):
        mine, theirs = draft_tok.convert_ids_to_tokens(i), target_tok.convert_ids_to_tokens(i)
        if mine != theirs:
            raise InputError(f"token id {i} is {mine!r} in the draft tokenizer but {theirs!r} in the target's: the vocabularies differ")


def _sample_ids(size: int, special_ids: list[int]) -> list[int]:
    """Every id for small vocabularies; else evenly spaced ids, the last 256 (added tokens) and the specials."""
    if size <= SAMPLED_TOKEN_IDS:
        return list(range(size))
    spread = torch.linspace(0, size - 1, SAMPLED_TOKEN_IDS).long().tolist()
    return sorted(set(spread) | set(range(size - 256, size)) | {i for i in special_ids if 0 <= i < size})


def _local_tokenizer(model: nn.Module, role: str):
    """The tokenizer saved next to a model's checkpoint, or None when there is none (a broken one is an InputError)."""
    path = Path(getattr(model, "name_or_path", "") or "")
    if not str(path) or not path.is_dir() or not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return load_tokenizer(path, role)


def warn_if_bigger(draft: nn.Module, target: nn.Module) -> None:
    """Warn when the draft has more parameters than the target: drafting then costs more than it saves."""
    draft_params = sum(p.numel() for p in draft.parameters())
    target_params = sum(p.numel() for p in target.parameters())
    if draft_params > target_params:
        warnings.warn(
            f"draft model has {draft_params:,} parameters, more than the target's {target_params:,}: it cannot pay",
            stacklevel=3,
        )
