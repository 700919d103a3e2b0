"""Suffix decoding: draft what followed the context's suffix, in this request and in earlier ones.

As in SuffixDecoding (Oliaro et al. 2024; ArcticInference, vLLM's ``method: suffix``):
two suffix structures, one over the current request (prompt + output) and one over
earlier requests' prompts and outputs (outputs only without ``cache_prompts``), each
counting how often every continuation occurred. A step matches the context's suffixes (up
to ``max_match`` tokens) in each, grows a speculation tree from each match by empirical
continuation probability, best first, under a node budget of ``alpha * match length`` (at
most ``max_nodes``), and keeps the tree with the highest score (the sum of its nodes' path
probabilities: the expected number of accepted tokens under the counts). Every match
length is tried, as ArcticInference does, except shorter ones that occurred exactly where
a longer one did; trying only the longest gave taus 3-8% lower on the demo domains.

The structures are tries of every substring up to ``max_match + k`` tokens (a suffix tree
cut at that depth, as ArcticInference's). Appending a token updates one node per depth,
and matching follows the same per-depth nodes, so a step costs O(depth + draft), whatever
the context's length. The global trie holds at most ``max_cached_tokens`` tokens; the
oldest requests are evicted first (their counts subtracted, empty nodes freed). It lives
as long as the proposer: every ``generate`` call adds its request when the next one
begins (or on ``flush``). ``save_store`` / ``store:`` write and read it as JSON, with the
tokenizer's fingerprint.

Drafts are lookups, so every node is a point mass: the output is exact at any temperature.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import deque
from pathlib import Path

import torch

from .core.engine import EngineExport, check_format, config_export
from .core.errors import InputError, check_integer, check_real
from .core.files import read_text, write_text_atomic
from .core.models import context_limit, output_vocab_size
from .core.proposer import ProposerBase
from .core.types import Draft, ProposeContext, TargetFeatures, VerifyResult
from .suffix_trie import SuffixTrie

STORE_FORMAT = "draftsmith-suffix-store"
STORE_VERSION = 1


class SuffixProposer(ProposerBase):
    """Draft from suffix tries over this request and over earlier requests' outputs.

    Args:
        k: deepest draft node.
        max_nodes: node budget of a step's tree.
        max_match: longest context suffix matched.
        alpha: the tree has at most ``alpha * match length`` nodes (SuffixDecoding's
            ``max_spec_factor``): a long match earns a long draft. 4 drafted more accepted
            tokens than 1 or 2 on every demo domain (``benchmarks/RESULTS.md``), where a
            verified node costs little.
        min_token_prob: a node is drafted only when its path probability reaches this.
        min_score: draft at all only when the tree's score (expected accepted tokens)
            reaches this (0: whenever something matched).
        global_store: also match earlier requests (False: this request only).
        cache_prompts: the global store keeps earlier prompts too, not only outputs (a
            later turn that repeats an earlier prompt then matches from its first step).
        max_cached_tokens: the global store's bound, in tokens; the oldest requests go
            first. At least one request: the target's context, when the target is given.
        store: a store saved with ``save_store`` to start from.
        target, tokenizer: the target and its tokenizer (vocabulary and fingerprint checks).
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self,
        k: int = 16,
        max_nodes: int = 24,
        max_match: int = 16,
        alpha: float = 4.0,
        min_token_prob: float = 0.1,
        min_score: float = 0.0,
        global_store: bool = True,
        cache_prompts: bool = True,
        max_cached_tokens: int = 1_000_000,
        store: str | None = None,
        target=None,
        tokenizer=None,
    ):
        for name, value in (("k", k), ("max_nodes", max_nodes), ("max_match", max_match), ("max_cached_tokens", max_cached_tokens)):
            if check_integer(name, value) < 1:
                raise InputError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0.0 < check_real("alpha", alpha) < math.inf:
            raise InputError(f"alpha must be a finite number > 0, got {alpha!r}")
        if not 0.0 <= check_real("min_token_prob", min_token_prob) <= 1.0:
            raise InputError(f"min_token_prob must be in [0, 1], got {min_token_prob!r}")
        if not 0.0 <= check_real("min_score", min_score) < math.inf:
            raise InputError(f"min_score must be a finite number >= 0, got {min_score!r}")
        limit = context_limit(target) if target is not None else None
        if limit is not None and max_cached_tokens < limit:
            raise InputError(
                f"max_cached_tokens={max_cached_tokens} is under one request: the target's context holds {limit} tokens; "
                f"give at least {limit}"
            )
        self.k, self.max_nodes, self.max_match, self.alpha = k, max_nodes, max_match, float(alpha)
        self.min_token_prob, self.min_score = float(min_token_prob), float(min_score)
        self.global_store, self.cache_prompts, self.max_cached_tokens = global_store, cache_prompts, max_cached_tokens
        self.vocab_size = output_vocab_size(target) if target is not None else None
        self.fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
        self.depth = max_match + k
        self._initial: list[list[int]] = read_store(store, self.vocab_size, self.fingerprint) if store is not None else []
        self.reset()

    # -- lifecycle ---------------------------------------------------------------------

    def draft_depth(self) -> int:
        return self.k

    def draft_width(self) -> int:
        return self.max_nodes  # a tree of the continuations seen, as wide as its budget

    def reset(self) -> None:
        """Forget every request seen since construction (the global store goes back to ``store``)."""
        self.cache = SuffixTrie(self.depth)
        self.cached: deque[int] = deque()  # sequence ids in the global trie, oldest first
        self.cached_tokens = 0
        self._next_id = 0
        for tokens in self._initial:
            self._cache(tokens)
        self._pending = False
        self._start([])

    def begin(self, prompt: list[int], features: TargetFeatures | None) -> None:
        self.flush()
        self._start(prompt)
        self._pending = True

    def _start(self, prompt: list[int]) -> None:
        """A new request's state; its trie catches up with the context only when asked to draft (``propose``)."""
        self._request = SuffixTrie(self.depth)
        self._tokens: list[int] = []  # the request's tokens its trie holds
        self._request.seqs[0] = self._tokens
        self._seen = list(prompt)  # every token of the request so far
        self._active: list[int] = []
        self._matches: list[tuple[int, int]] = []
        self._prompt_len = len(prompt)

    def observe(self, result: VerifyResult, features: TargetFeatures | None) -> None:
        self._seen += result.committed  # cheap: steps the controller plans plain never build the trie

    def flush(self) -> None:
        """Add the request in progress (or just finished) to the global store, once."""
        if self._pending and self.global_store:
            self._cache(self._seen if self.cache_prompts else self._seen[self._prompt_len :])
        self._pending = False

    def export(self, out_dir: str | Path, format: str = "vllm") -> EngineExport:
        """vLLM's ``suffix`` method (ArcticInference's suffix cache) with these settings; nothing is trained.

        The engine's tree is ``max_match + k`` deep and its speculation factor is ``alpha``.
        It differs in two ways that have no setting: it drafts the best path only (no tree
        of ``max_nodes``), and it bounds its global store in requests, not tokens (the
        default, 10000; 0 when ``global_store`` is off). A saved ``store`` is not exported.
        """
        check_format(format, ("vllm",), "suffix")
        spec = {
            "method": "suffix",
            "num_speculative_tokens": self.k,
            "suffix_decoding_max_tree_depth": self.max_match + self.k,
            "suffix_decoding_max_spec_factor": self.alpha,
            "suffix_decoding_min_token_prob": self.min_token_prob,
        }
        if not self.global_store:
            spec["suffix_decoding_max_cached_requests"] = 0
        return config_export(out_dir, format, spec)

    # -- drafting ----------------------------------------------------------------------

    def propose(self, context: ProposeContext) -> Draft:
        tokens = context.tokens
        if len(tokens) < len(self._tokens):  # a new request without begin(): start over
            self.begin(tokens, None)
        self._seen[len(self._tokens) :] = tokens[len(self._tokens) :]  # the context is the truth (a caller may not observe)
        self._extend(tokens[len(self._tokens) :])
        depth = min(self.k, context.max_depth)
        best: tuple[list[int], list[int], float] = ([], [], 0.0)
        for trie, states in ((self._request, self._request_states()), (self.cache, self._global_states())):
            for state in states:
                draft = self._speculate(trie, state, depth)
                if draft[2] > best[2]:
                    best = draft
        ids, parents, score = best
        if not ids or score < self.min_score:
            return Draft.empty()
        return Draft(torch.tensor(ids, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def _request_states(self) -> list[tuple[int, int]]:
        """Suffixes of the context (at most ``max_match`` long) that occurred earlier in this request with a continuation."""
        trie = self._request
        found = [(node, 0) for node in self._active if trie.level[node] <= self.max_match and trie.explicit[node] and trie.total[node]]
        return _distinct(trie, found)  # implicit nodes occurred once: here

    def _global_states(self) -> list[tuple[int, int]]:
        """Suffixes of the context found in the global store with a continuation."""
        return _distinct(self.cache, [state for state in self._matches if self.cache.continued(*state)]) if self.global_store else []

    def _speculate(self, trie: SuffixTrie, state: tuple[int, int], depth: int) -> tuple[list[int], list[int], float]:
        """The tree below a matched state, of at most ``alpha`` x its length nodes."""
        node, extra = state
        budget = min(self.max_nodes, int(self.alpha * (trie.level[node] + extra)))
        return trie.speculate(node, extra, budget, depth, self.min_token_prob)

    def _extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self._tokens.append(token)
            self._active = self._request.append(self._active, 0, len(self._tokens) - 1)
            if self.global_store:
                self._matches = self.cache.follow(self._matches, token, self.max_match)

    # -- the global store ----------------------------------------------------------------

    def _cache(self, tokens: list[int]) -> None:
        tokens = list(tokens[-self.max_cached_tokens :])
        if not tokens:
            return
        self.cache.add(self._next_id, tokens)
        self.cached.append(self._next_id)
        self._next_id += 1
        self.cached_tokens += len(tokens)
        while self.cached_tokens > self.max_cached_tokens:
            oldest = self.cached.popleft()
            self.cached_tokens -= len(self.cache.seqs[oldest])
            self.cache.remove(oldest)

    def cached_requests(self) -> list[list[int]]:
        """The requests the global store holds, oldest first."""
        return [self.cache.seqs[seq] for seq in self.cached]

    def save_store(self, path: str | Path) -> Path:
        """Write the global store (the requests it holds, oldest first) as JSON, atomically; return the path."""
        self.flush()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": STORE_FORMAT,
            "version": STORE_VERSION,
            "vocab_size": self.vocab_size,
            "tokenizer": self.fingerprint,
            "requests": self.cached_requests(),
        }
        write_text_atomic(path, json.dumps(payload))
        return path


def _distinct(trie: SuffixTrie, states: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Of matched states (shortest first), the longest of each occurrence count, longest first.

    Every match length is a candidate (as in ArcticInference): a shorter suffix may have
    occurred more often and predict better, while a longer one earns a larger budget. A
    shorter suffix with the same count occurred at the same places, so it has the same
    continuations and a smaller budget: it is skipped.
    """
    out: list[tuple[int, int]] = []
    for node, extra in reversed(states):
        if not out or trie.count[node] != trie.count[out[-1][0]]:
            out.append((node, extra))
    return out


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary (every token string and its id)."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


def read_store(path: str | Path, vocab_size: int | None, fingerprint: str | None) -> list[list[int]]:
    """The requests of a saved store; InputError on another format, vocabulary or tokenizer."""
    where = f"suffix store {path}"
    try:
        payload = json.loads(read_text(path, "suffix store"))
    except json.JSONDecodeError as err:
        raise InputError(f"{where} is not valid JSON ({err.msg})") from None
    if not isinstance(payload, dict) or payload.get("format") != STORE_FORMAT or payload.get("version") != STORE_VERSION:
        raise InputError(f"{where} is not a suffix store of format {STORE_FORMAT!r} version {STORE_VERSION} (written by save_store)")
    theirs = payload.get("tokenizer")
    if fingerprint is not None and theirs is not None and theirs != fingerprint:
        raise InputError(f"{where} was saved with another tokenizer (fingerprint {theirs}, this target's is {fingerprint})")
    stored_vocab = payload.get("vocab_size")
    if vocab_size is not None and stored_vocab is not None and stored_vocab != vocab_size:
        raise InputError(f"{where} was saved for a vocabulary of {stored_vocab} tokens, this target's has {vocab_size}")
    requests = payload.get("requests")
    bound = vocab_size if vocab_size is not None else stored_vocab
    valid = isinstance(requests, list) and all(isinstance(r, list) for r in requests)
    valid = valid and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for r in requests for t in r)
    if not valid:
        raise InputError(f"{where}: 'requests' must be a list of lists of token ids >= 0")
    if bound is not None and any(t >= bound for r in requests for t in r):
        raise InputError(f"{where} holds token ids outside the vocabulary [0, {bound})")
    return requests
