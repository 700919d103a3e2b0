"""Prompt lookup: draft what followed earlier occurrences of the context's last n tokens.

As in prompt-lookup decoding (Saxena 2023) and vLLM's n-gram proposer, with an n-gram
index kept incrementally per request, so a lookup is a dict probe rather than a scan.
With ``branches > 1`` the continuations of several earlier matches are merged into a
tree that the verifier scores in one forward.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from .core.engine import EngineExport, check_format, config_export
from .core.errors import InputError
from .core.proposer import ProposerBase
from .core.tree import merge_drafts
from .core.types import Draft, ProposeContext, TargetFeatures, TransformersPeer, VerifyResult

MATCHES = ("latest", "earliest")


class NgramProposer(ProposerBase):
    """Propose the continuation of the most recent earlier match of the context's suffix.

    Args:
        min_n: shortest suffix length to match.
        max_n: longest suffix length to match; longer matches are tried first.
        k: tokens proposed per branch (draft depth).
        branches: distinct earlier matches to draft from; 1 gives a chain, more a tree.
        max_nodes: node budget of a tree (default ``k * branches``).
        match: which earlier occurrence of the longest matching n-gram drafts first:
            ``latest`` (the most recent), or ``earliest`` (vLLM's n-gram proposer).
        wrap: a continuation that runs into the context's end continues with its own
            copy (a repeating pattern still gives ``k`` tokens); False stops it at the end,
            as vLLM does.
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self,
        min_n: int = 2,
        max_n: int = 4,
        k: int = 5,
        branches: int = 1,
        max_nodes: int | None = None,
        match: str = "latest",
        wrap: bool = True,
    ):
        if not 1 <= min_n <= max_n:
            raise InputError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if k < 1 or branches < 1:
            raise InputError(f"k and branches must be >= 1, got k={k}, branches={branches}")
        if match not in MATCHES:
            raise InputError(f"match must be one of {list(MATCHES)}, got {match!r}")
        self.min_n, self.max_n, self.k, self.branches = min_n, max_n, k, branches
        self.match, self.wrap = match, wrap
        self.max_nodes = max_nodes if max_nodes is not None else k * branches
        if self.max_nodes < 1:
            raise InputError(f"max_nodes must be >= 1, got {max_nodes}")
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0

    def draft_depth(self) -> int:
        return self.k

    def draft_width(self) -> int:
        return self.branches

    def begin(self, prompt: list[int], features: TargetFeatures | None) -> None:
        self._index = {}
        self._indexed = 0

    def observe(self, result: VerifyResult, features: TargetFeatures | None) -> None:
        pass  # the index catches up from context.tokens in propose()

    def transformers_peer(self) -> TransformersPeer | None:
        """transformers' prompt lookup with the same depth and longest n-gram (chains only: it has no trees)."""
        if self.branches > 1:
            return None
        return TransformersPeer("hf_prompt_lookup", {"prompt_lookup_num_tokens": self.k, "max_matching_ngram_size": self.max_n})

    def export(self, out_dir: str | Path, format: str = "vllm") -> EngineExport:
        """vLLM's n-gram drafting with the same n-gram sizes and depth (its ``speculative_config``; nothing is trained).

        vLLM drafts one chain per step, so a tree (``branches > 1``) is refused. It drafts
        from the earliest match and stops at the context's end: other settings warn, as
        the engine will draft differently (``match: earliest, wrap: false`` drafts as it does).
        """
        check_format(format, ("vllm",), "ngram")
        if self.branches > 1:
            raise InputError(f"vLLM's ngram method drafts a chain: export needs branches: 1, got branches: {self.branches}")
        if self.match != "earliest" or self.wrap:
            warnings.warn(
                f"vLLM drafts from the earliest match and stops at the context's end; this proposer has match: {self.match}, "
                f"wrap: {self.wrap} (match: earliest, wrap: false drafts as the engine does)",
                stacklevel=2,
            )
        spec = {"method": "ngram", "prompt_lookup_min": self.min_n, "prompt_lookup_max": self.max_n, "num_speculative_tokens": self.k}
        return config_export(out_dir, format, spec)

    def propose(self, context: ProposeContext) -> Draft:
        tokens = context.tokens
        self._update_index(tokens)
        depth = min(self.k, context.max_depth)
        continuations = self._continuations(tokens, depth, min(self.branches, context.max_width or self.branches))
        if not continuations:
            return Draft.empty()
        if len(continuations) == 1:
            return Draft.chain(continuations[0])
        return merge_drafts([Draft.chain(c) for c in continuations], self.max_nodes)

    def _update_index(self, tokens: list[int]) -> None:
        """Index every n-gram that has at least one token after it (so not the current suffix)."""
        if self._indexed > len(tokens):  # a new request without begin(): start over
            self._index, self._indexed = {}, 0
        for end in range(max(self._indexed, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._index.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self._indexed = max(self._indexed, len(tokens))

    def _continuations(self, tokens: list[int], depth: int, branches: int) -> list[list[int]]:
        """Up to ``branches`` distinct continuations, longest suffix match first, then the latest (or earliest) occurrence first."""
        found: list[list[int]] = []
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            starts = self._index.get(tuple(tokens[-n:]), ())
            for start in reversed(starts) if self.match == "latest" else starts:
                continuation = _copy(tokens, start, depth) if self.wrap else tokens[start : start + depth]
                if continuation not in found:
                    found.append(continuation)
                    if len(found) == branches:
                        return found
        return found


def _copy(tokens: list[int], start: int, depth: int) -> list[int]:
    """``depth`` tokens from ``start`` on, LZ77-style: a copy that runs past the end continues
    with its own output, so a match just before the end (a repeating pattern) still
    yields a full-length draft."""
    out = tokens[start : start + depth]
    period = len(tokens) - start
    while len(out) < depth:
        out.append(out[len(out) - period])
    return out
