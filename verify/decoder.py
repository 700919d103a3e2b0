"""The decode loop: propose, score, accept, commit.

Plain decoding is the same loop with an empty draft, so every speedup is measured on
one harness.
"""

from __future__ import annotations

import copy
import numbers
import time
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from draftsmith.proposers.core.cache import CACHE_HEADROOM
from draftsmith.proposers.core.devices import SeededGenerators, reads_are_free
from draftsmith.proposers.core.errors import InputError, check_integer
from draftsmith.proposers.core.lean_forward import fast_paths, forward_mode
from draftsmith.proposers.core.models import check_full_attention, context_limit, decode_threads, output_vocab_size, torch_threads
from draftsmith.proposers.core.proposer import Proposer, check_proposer
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.core.tree import limit_width, prune_depth, validate_draft
from draftsmith.proposers.core.types import Draft, ProposeContext, TargetFeatures, VerifyResult

from .controller import Controller, Plan
from .rejection import rejection_sample
from .stats import DecodeStats
from .target import Target, TargetOutput

WARM_UP_TOKENS = 8  # plain steps of a warm-up: each decode shape runs a few times


@dataclass(frozen=True)
class DecodeResult:
    """What generate() returns.

    Args:
        new_tokens: the generated token ids (prompt excluded), EOS included if hit.
        stats: counters and timings.
        controller: the speculation controller's estimates at the end of the request
            (``Controller.snapshot``: costs in ms, acceptance by depth, steps planned per
            depth); None without a controller.
    """

    new_tokens: list[int]
    stats: DecodeStats
    controller: dict | None = None


@dataclass(frozen=True)
class DraftStep:
    """One step's plan, the draft to verify, and the indices it keeps of what the proposer drafted (None: all).

    Args:
        draft_seconds: the proposer's own time drafting it.
    """

    plan: Plan
    draft: Draft
    kept: list[int] | None = None
    draft_seconds: float = 0.0

    def as_proposed(self, result: VerifyResult) -> VerifyResult:
        """``result`` with the accepted nodes numbered as the proposer drafted them (what its ``observe`` expects)."""
        if self.kept is None:
            return result
        return replace(result, accepted_nodes=[self.kept[i] for i in result.accepted_nodes])


@dataclass(frozen=True)
class Request:
    """One generate call's arguments, checked and normalised (``SpeculativeDecoder.check_request``).

    Args:
        input_ids: ``[1, T]`` long, on the model's device.
        prompt: the same ids as a list.
        max_new_tokens: at least 1; the prompt plus this fits the target's positions.
        sampling: temperature, top-k, top-p.
        seed: the generator's seed, or None for an unseeded generator.
        eos: the ids that end generation (empty: none).
    """

    input_ids: torch.Tensor
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int | None
    eos: frozenset[int]


class SpeculativeDecoder:
    """Generate with a target model, drafting with ``proposer`` (None = plain decoding).

    Args:
        model: a Hugging Face causal LM with full-attention layers (sliding-window models
            are refused); it is put in eval mode and never modified.
        proposer: any ``Proposer``; None decodes one token per target forward.
        preallocated_cache: keep the target's KV cache in buffers written in place
            (``proposers.core.cache``) when a probe shows the model's logits unchanged by it;
            else (or False) transformers' ``DynamicCache``. None: on unless the environment
            sets ``DRAFTSMITH_FAST_PATHS=0``.
        lean_forward: score drafts through the model's own submodules (``proposers.core.lean_forward``)
            when a probe shows that gives its forward's logits; None as above.
        compile_forward: run that lean forward through ``torch.compile`` (off by default:
            each new input kind compiles for seconds, which only a long run wins back;
            ``benchmarks/RESULTS.md``). Needs the lean forward and the preallocated cache;
            without them it is ignored with a logged reason.
        adaptive: let the speculation controller (``verify.controller``) decide each step
            how deep to draft, down to a plain step, and which nodes to verify, from the
            costs and acceptance it measures (on by default); False drafts with the
            proposer's fixed config every step, as a paper's setting would. Either way the
            output is exact; with it, which tokens a seed gives at temperature > 0 also
            depends on the measured costs (the law does not).
        threads: torch intra-op threads while it decodes (restored after each call); None:
            ``decode_threads``'s rule, 1 for a model under 50M parameters (as fast idle, and
            several times faster when anything else runs), torch's default above.
        controller: a controller of one's own (another ``Controller``'s settings, or one
            shared by decoders of the same proposer); given, it is used whatever ``adaptive`` says.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        proposer: Proposer | None = None,
        preallocated_cache: bool | None = None,
        lean_forward: bool | None = None,
        compile_forward: bool = False,
        adaptive: bool = True,
        controller: Controller | None = None,
        threads: int | None = None,
    ):
        check_full_attention(model, "target")
        self.model = model.eval()
        paths = fast_paths(self.model, "target", preallocated_cache, lean_forward, compile_forward)
        self.preallocate, self.lean, self.compiled, self.forward = paths.preallocate, paths.lean, paths.compiled, paths.forward
        self.proposer = check_proposer(proposer) if proposer is not None else None
        self.vocab_size = output_vocab_size(model)
        self.max_positions = context_limit(model)
        self.threads = decode_threads(model, threads)
        proposer_vocab = proposer.vocab_size if proposer is not None else None
        if proposer_vocab is not None and proposer_vocab != self.vocab_size:
            raise InputError(f"proposer vocabulary size {proposer_vocab} differs from the target's {self.vocab_size}")
        # one controller per decoder: the costs it learns are this machine's, across requests
        self._own_controller = controller is None and self.proposer is not None and adaptive
        if self._own_controller:
            controller = self._new_controller()
        self.controller = controller if self.proposer is not None else None

    def _new_controller(self) -> Controller:
        return Controller(self.proposer.draft_depth(), self.proposer.draft_width())

    def reset(self) -> None:
        """Forget what was learnt across requests: the proposer's (``Proposer.reset``), and the controller's where the
        decoder built its own (a fresh one); a controller passed in is its owner's to reset.

        After a warm-up, so that the requests that count start from costs without the first calls' one-off ones.
        """
        if self.proposer is not None:
            self.proposer.reset()
        if self._own_controller:
            self.controller = self._new_controller()

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | list[int] | torch.Tensor | None = None,
    ) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (``[1, T]`` long).

        At temperature 0 the output is token-identical to plain greedy decoding; at
        temperature > 0 it follows the target's processed distribution exactly. Every
        argument is checked once, up front (``check_request``); a bad one is an ``InputError``.

        Args:
            input_ids: ``[1, T]`` integer tensor of ids in the target's vocabulary.
            max_new_tokens: an integer >= 1; the prompt plus this must fit the target's positions.
            temperature: a finite real >= 0 (0 = greedy).
            top_k: an integer >= 0 (0 = no top-k).
            top_p: a real in (0, 1] (1 = no top-p).
            seed: an integer, or None for an unseeded generator.
            eos_token_id: None, an id, or several (a list / tuple, or a 0-d / 1-D integer tensor).
        """
        request = self.check_request(input_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id)
        with forward_mode(self.compiled), torch_threads(self.threads):
            return self._generate(request)

    def warm_up(self, prompt_tokens: int, new_tokens: int = WARM_UP_TOKENS) -> float:
        """Decode untimed after a dummy prompt of ``prompt_tokens`` tokens, plain and then drafting; return the seconds it took.

        A fresh process pays one-off costs in its first forwards of each shape (kernel
        selection, the allocator, the thread pool), which a warm request does not
        (``benchmarks/bench_generate.py`` measures the first request). A server warms up before it takes requests;
        ``draftsmith generate`` calls this before its one request (``--no-warm-up`` skips
        it). With a proposer, a second decode drafts with its fixed config (its forwards and the
        target's scoring of a draft pay theirs too), and the proposer is ``reset`` after. The
        controller takes no part: what it learns stays the requests', and from warm forwards
        (one that learnt from first ones took their one-off costs for what drafting costs).
        """
        prompt_tokens, new_tokens = check_integer("prompt_tokens", prompt_tokens), check_integer("new_tokens", new_tokens)
        if prompt_tokens < 1 or new_tokens < 1:
            raise InputError(f"prompt_tokens and new_tokens must be >= 1, got {prompt_tokens} and {new_tokens}")
        if self.max_positions is not None:  # a longer request than the model holds warms up as the longest it holds
            prompt_tokens = max(1, min(prompt_tokens, self.max_positions - new_tokens))
            new_tokens = min(new_tokens, self.max_positions - prompt_tokens)
        warm = copy.copy(self)  # the same model and forward, without the proposer or the controller
        warm.proposer = warm.controller = None
        dummy = torch.arange(prompt_tokens)[None] % self.vocab_size
        tick = time.perf_counter()
        warm.generate(dummy, max_new_tokens=new_tokens)
        if self.proposer is not None:  # then drafting at its fixed config (still no controller), and forgotten
            warm.proposer = self.proposer
            warm.generate(dummy, max_new_tokens=new_tokens)
            self.proposer.reset()
        return time.perf_counter() - tick

    def _generate(self, request: Request) -> DecodeResult:
        input_ids, prompt, max_new_tokens = request.input_ids, request.prompt, request.max_new_tokens
        sampling, eos = request.sampling, request.eos
        proposer = self.proposer
        target = Target(self.model, proposer.hidden_layers if proposer is not None else (), self.preallocate, self.forward)
        # the verifier draws on the device of the target's logits; a draft elsewhere asks ProposeContext.generator_for
        generators = SeededGenerators(request.seed, target.output_device) if request.seed is not None else None
        generator = generators.on(target.output_device) if generators is not None else None
        stats = DecodeStats()
        controller_before = self.controller.seconds if self.controller is not None else 0.0
        start = time.perf_counter()

        out = target.prefill(input_ids, capacity=len(prompt) + max_new_tokens + CACHE_HEADROOM)
        first = rejection_sample(Draft.empty(), out.logits[-1:], sampling, generator).next_token
        stats.requests = stats.target_forwards = 1
        stats.ttft = time.perf_counter() - start
        last = first
        tokens = prompt + [first]
        new_tokens = [first]
        if self.controller is not None:
            self.controller.start()
        if proposer is not None:
            tick = time.perf_counter()
            proposer.begin(prompt, out.features)
            stats.draft_time += time.perf_counter() - tick

        while len(new_tokens) < max_new_tokens and last not in eos:
            tick = time.perf_counter()
            # 0. plan and 1. propose: how deep to draft (0: a plain step), the draft, the nodes worth a row
            step = self._propose(tokens, max_new_tokens - len(new_tokens), sampling, generators, target)
            draft, context = step.draft, len(tokens)
            tock = time.perf_counter()
            # 2. score: root + every draft node in one target forward
            out = target.score(tokens[-1], draft)
            scored = time.perf_counter()
            # 3. accept
            result = rejection_sample(draft, out.logits, sampling, generator)
            # 4. commit
            target.commit(result.accepted_nodes)
            if proposer is not None:
                proposer.observe(step.as_proposed(result), _path_features(out, result, draft.num_nodes))
            emitted = _extend(tokens, new_tokens, result.committed, max_new_tokens, eos)
            last = new_tokens[-1]
            stats.target_forwards += 1
            stats.record_step(_depth(draft), draft.num_nodes, result.num_accepted, result.recovered, emitted, draft.source)
            stats.draft_time += tock - tick
            stats.score_time += scored - tock
            stats.verify_time += time.perf_counter() - tock
            if self.controller is not None:
                stats.planned_plain_steps += step.plan.depth == 0
                self.controller.observe(step.plan, draft, result, context, step.draft_seconds, time.perf_counter() - tick, sampling.greedy)

        stats.new_tokens = len(new_tokens)
        stats.total_time = time.perf_counter() - start
        if self.controller is None:
            return DecodeResult(new_tokens, stats)
        snapshot = self.controller.snapshot()  # it learns the steps a plain decision held first: controller work
        stats.controller_time = self.controller.seconds - controller_before
        return DecodeResult(new_tokens, stats, snapshot)

    def _propose(self, tokens, remaining, sampling, generators, target) -> DraftStep:
        """Plan the step, and ask the proposer for a draft no deeper than the plan, the output and the positions allow."""
        max_depth = remaining - 1
        if target.max_positions is not None:
            max_depth = min(max_depth, target.max_positions - len(tokens))
        if self.proposer is None or max_depth < 1:
            return DraftStep(Plan(0), Draft.empty())
        controller = self.controller
        plan = controller.plan(len(tokens), max_depth) if controller is not None else Plan(max_depth)
        if plan.depth == 0:
            return DraftStep(plan, Draft.empty())
        tick = time.perf_counter()
        generator = generators.on(target.output_device) if generators is not None else None
        stop = controller.stop_rule() if controller is not None and plan.trims else None  # a probe sees the whole draft
        draft = self.proposer.propose(ProposeContext(tokens, plan.depth, sampling, generator, plan.width, generators, stop))
        seconds = time.perf_counter() - tick
        validate_draft(draft, self.vocab_size, check_probs=reads_are_free(target.output_device))  # else the verifier's read checks them
        draft = limit_width(prune_depth(draft, plan.depth), plan.width)
        if controller is None or not plan.trims:  # what trimming would hide is what a probe learns from
            return DraftStep(plan, draft, None, seconds)
        trimmed, kept = controller.trim(draft, len(tokens), sampling.greedy or draft.draft_probs is None)
        return DraftStep(plan, trimmed, kept, seconds)

    def check_request(self, input_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id) -> Request:
        """Check every argument of ``generate`` against this target; raise ``InputError`` naming the first bad one."""
        max_new_tokens, sampling, seed = check_settings(max_new_tokens, temperature, top_k, top_p, seed)
        input_ids, prompt = self._check_prompt(input_ids)
        if self.max_positions is not None and len(prompt) + max_new_tokens > self.max_positions:
            raise InputError(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} needs {len(prompt) + max_new_tokens} positions, "
                f"more than the target's {self.max_positions} (max_position_embeddings): shorten the prompt or lower max_new_tokens"
            )
        return Request(input_ids, prompt, max_new_tokens, sampling, seed, _eos_set(eos_token_id, self.vocab_size))

    def _check_prompt(self, input_ids) -> tuple[torch.Tensor, list[int]]:
        """``input_ids`` as a ``[1, T]`` long tensor on the model's device, and as a list."""
        if not isinstance(input_ids, torch.Tensor):
            raise InputError(f"input_ids must be an integer tensor of shape [1, T] (batch of one request), got {type(input_ids).__name__}")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InputError(f"input_ids must be a LongTensor of shape [1, T] (batch of one request), got {tuple(input_ids.shape)}")
        if not _is_integer(input_ids.dtype):
            raise InputError(f"input_ids must hold integer token ids (a LongTensor), got dtype {input_ids.dtype}")
        if input_ids.shape[1] == 0:
            raise InputError("input_ids is empty: the prompt needs at least one token")
        prompt = input_ids[0].tolist()
        outside = next((i for i, token in enumerate(prompt) if not 0 <= token < self.vocab_size), None)
        if outside is not None:
            raise InputError(
                f"input_ids hold token id {prompt[outside]} at position {outside}, outside the vocabulary [0, {self.vocab_size})"
            )
        return input_ids.to(device=self.model.device, dtype=torch.long), prompt


def check_settings(max_new_tokens, temperature, top_k, top_p, seed) -> tuple[int, SamplingParams, int | None]:
    """The request settings that need no model, checked (``InputError`` naming the first bad one): (max_new_tokens, sampling, seed)."""
    sampling = SamplingParams(temperature, top_k, top_p)
    max_new_tokens = check_integer("max_new_tokens", max_new_tokens)
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if seed is not None:
        seed = check_integer("seed", seed)
        if not -(2**63) <= seed < 2**64:
            raise InputError(f"seed must be an integer in [-2**63, 2**64) or None, got {seed}")
    return max_new_tokens, sampling, seed


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _eos_set(eos_token_id, vocab_size: int) -> frozenset[int]:
    """The EOS ids from any form transformers' ``generate`` accepts: None, an int, a list / tuple, a 0-d / 1-D integer tensor."""
    if eos_token_id is None:
        return frozenset()
    allowed = "None, an int, a list / tuple of ints or a 0-d / 1-D integer tensor"
    if isinstance(eos_token_id, torch.Tensor):
        if eos_token_id.dim() > 1 or not _is_integer(eos_token_id.dtype):
            raise InputError(
                f"eos_token_id must be {allowed}, got a tensor of shape {tuple(eos_token_id.shape)} and dtype {eos_token_id.dtype}"
            )
        ids = eos_token_id.reshape(-1).tolist()
    else:
        ids = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
        if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
            raise InputError(f"eos_token_id must be {allowed}, got {eos_token_id!r}")
        ids = [int(i) for i in ids]
    outside = next((i for i in ids if not 0 <= i < vocab_size), None)
    if outside is not None:
        raise InputError(f"eos_token_id {outside} is outside the vocabulary [0, {vocab_size})")
    return frozenset(ids)


def _depth(draft: Draft) -> int:
    if draft.num_nodes == 0:
        return 0
    if draft.is_chain():
        return draft.num_nodes
    return max(draft.depth_list)


def _extend(tokens: list[int], new_tokens: list[int], committed: list[int], max_new_tokens: int, eos: frozenset[int]) -> int:
    """Append committed tokens, stopping at EOS or the output limit; return how many were appended."""
    emitted = 0
    for token in committed[: max_new_tokens - len(new_tokens)]:
        tokens.append(token)
        new_tokens.append(token)
        emitted += 1
        if token in eos:
            break
    return emitted


def _path_features(out: TargetOutput, result: VerifyResult, drafted: int) -> TargetFeatures | None:
    """Hidden states of the root and the accepted nodes, in path order (``drafted``: the draft's nodes)."""
    if out.features is None:
        return None
    accepted = result.accepted_nodes
    if drafted == 0:  # a plain step: its one row as it is
        return out.features
    if accepted == list(range(len(accepted))):  # a chain's accepted prefix: rows 0..n, a view
        return TargetFeatures({layer: h[: len(accepted) + 1] for layer, h in out.features.hidden_states.items()})
    rows = [0] + [i + 1 for i in accepted]  # on each layer's device (a target split over devices has its layers on several)
    return TargetFeatures(
        {layer: h.index_select(0, torch.tensor(rows, device=h.device)) for layer, h in out.features.hidden_states.items()}
    )
