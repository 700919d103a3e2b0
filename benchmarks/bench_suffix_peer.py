"""Our suffix decoding beside ArcticInference's suffix cache (the implementation vLLM uses), on the demo's prompts.

The peer drafts with ``arctic_inference.suffix_decoding.SuffixDecodingCache`` behind our
proposer interface, and our verifier checks its drafts like any other; so taus and speeds
compare the two suffix structures and their tree rules on the same prompts, target and
verifier. Like ArcticInference, the peer caches earlier *outputs* only (its prompts stay
per request); ``suffix_outputs`` is ours with the same setting and its default factor.

Needs the ``arctic-inference`` package, which builds from source on a CPU-only machine in
its own venv (torch first, then the build tools, then the package without build isolation):

    python -m venv .venv-arctic && . .venv-arctic/bin/activate && pip install torch==2.13.0
    pip install setuptools wheel ninja cmake nanobind==2.9.2 protobuf==5.29.6 grpcio-tools numpy
    pip install --no-build-isolation --no-deps arctic-inference==0.3.0 && pip install -e .
    python -m benchmarks.bench_suffix_peer [--output outputs/suffix_peer] [--prompts 8]

(0.3.0's ``speculate`` needs ``max_spec_tokens`` given: without it, it reads an attribute
that does not exist.)
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np
import torch

from draftsmith.proposers.core.proposer import ProposerBase
from draftsmith.proposers.core.types import Draft, ProposeContext, TargetFeatures, VerifyResult
from draftsmith.proposers.registry import REGISTRY
from draftsmith.training.demo.run import heldout_documents
from draftsmith.verify.evaluation.demo import build_domains
from draftsmith.verify.evaluation.evaluate import DomainFile, EvalConfig, evaluate
from draftsmith.verify.evaluation.report import markdown_table


class ArcticSuffixProposer(ProposerBase):
    """ArcticInference's ``SuffixDecodingCache`` as a draftsmith proposer (tree speculation)."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, max_tree_depth: int = 64, max_spec_tokens: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self._make = lambda: SuffixDecodingCache(max_tree_depth=max_tree_depth)
        self.max_tree_depth, self.max_spec_tokens = max_tree_depth, max_spec_tokens
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self._ids = itertools.count()
        self.reset()

    def reset(self) -> None:
        self.cache = self._make()
        self._request = None
        self._seen = 0

    def begin(self, prompt: list[int], features: TargetFeatures | None) -> None:
        if self._request is not None:
            self.cache.stop_request(self._request)
        self._request = next(self._ids)
        self.cache.start_request(self._request, np.asarray(prompt, dtype=np.int32))
        self._seen = len(prompt)

    def _add(self, tokens: list[int]) -> None:
        if tokens:
            self.cache.add_active_response(self._request, np.asarray(tokens, dtype=np.int32))
            self._seen += len(tokens)

    def observe(self, result: VerifyResult, features: TargetFeatures | None) -> None:
        self._add(result.committed)

    def propose(self, context: ProposeContext) -> Draft:
        self._add(context.tokens[self._seen :])  # the prefill's token, which no observe() reports
        draft = self.cache.speculate(
            self._request,
            np.asarray(context.tokens[-self.max_tree_depth :], dtype=np.int32),
            max_spec_tokens=self.max_spec_tokens,
            max_spec_factor=self.max_spec_factor,
            min_token_prob=self.min_token_prob,
            use_tree_spec=True,
        )
        if not draft.token_ids:
            return Draft.empty()
        return Draft(torch.tensor(draft.token_ids, dtype=torch.long), torch.tensor(draft.parents, dtype=torch.long))

    def transformers_peer(self):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="recipes/models/demo_target")
    parser.add_argument("--output", default="outputs/suffix_peer")
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()

    REGISTRY["arctic_suffix"] = ArcticSuffixProposer  # a class entry: no import string needed
    paths = build_domains(heldout_documents(Path(args.target)), Path(args.output) / "domains", args.prompts, 4 * 128)
    domains = {name: paths[name] for name in ("code", "prose", "copy", "repeat")}
    domains["mixed"] = DomainFile(paths["mixed"], num_prompts=2 * args.prompts)
    proposers = {
        "ngram": {"type": "ngram"},
        "suffix": {"type": "suffix"},
        "suffix_outputs": {"type": "suffix", "cache_prompts": False, "alpha": 1.0},
        "suffix_outputs_a4": {"type": "suffix", "cache_prompts": False},
        "arctic": {"type": "arctic_suffix"},
        "arctic_a4": {"type": "arctic_suffix", "max_spec_factor": 4.0},
    }
    config = EvalConfig(
        target=args.target,
        domains=domains,
        proposers=proposers,
        peers=False,
        num_prompts=args.prompts,
        prompt_tokens=128,
        max_new_tokens=64,
        output_dir=args.output,
        threads=1,
    )
    summary = evaluate(config)
    print(markdown_table(summary["rows"]))


if __name__ == "__main__":
    main()
