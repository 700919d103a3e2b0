"""Run a stock decoder-only LM's own submodules, without its wrapper's per-call work.

``model(input_ids, cache=...)`` re-derives the cache length and the positions, builds an
attention mask, runs output-capturing hooks and wraps every result in dataclasses. For a
small draft that work is a third of a decode step on a CPU (0.9 ms -> 0.6 ms per token for
a 1-layer, hidden-128 Llama). A proposer already knows its positions and masks, so it can
call ``embed_tokens -> rotary_emb -> layers -> norm -> lm_head`` itself.

Nothing is re-implemented and nothing is patched: the same modules run on the same cache.
``LeanForward.probe`` runs both paths on a short input when a proposer is built, and the
lean path is used only when it gives the wrapper's logits; other models keep the wrapper.
"""

from __future__ import annotations

import contextlib
import logging
import os
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .cache import cache_probe_passes, fast_path_enabled
from .fused_layers import FusedLayers

logger = logging.getLogger(__name__)
PROBE_TOKENS = 6
FUSED_SWITCH = "DRAFTSMITH_FUSED_LAYERS"  # 0: the lean forward calls the layers' own modules
LEAN_MAX_ROWS = (
    64  # a draft tree of up to 63 nodes and its root; longer inputs (prompts) take the model's own forward and its causal kernel
)
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")  # the ones that take a 4D additive float mask as given
# RoPE variants whose cos / sin depend on the position only (``dynamic`` and ``longrope``
# rescale with the sequence length): their rotary embedding is looked up in a table.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class LeanForward:
    """Calls of a ``*ForCausalLM``'s submodules that match its own forward.

    Args:
        model: a causal LM with ``model.model.{embed_tokens, rotary_emb, layers, norm}`` and
            ``model.lm_head`` (the Llama / Mistral / Qwen layout). Build with ``probe``.
    """

    def __init__(self, model: nn.Module):
        backbone = model.model
        self.embed, self.rotary, self.norm, self.head = backbone.embed_tokens, backbone.rotary_emb, backbone.norm, model.lm_head
        self.layers = list(backbone.layers[: model.config.num_hidden_layers])
        self.fused: FusedLayers | None = None  # the same layers in fused ops (``probe`` decides)
        self.dtype = model.dtype
        # cos / sin of positions 0..n-1, computed by the model's own rotary module once and
        # looked up per call (doubled when a position runs past them); None: call it every time.
        self.rotary_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.static_rotary = getattr(self.rotary, "rope_type", None) in STATIC_ROPE_TYPES

    def __call__(
        self,
        input_ids: torch.Tensor,
        cache: DynamicCache,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        last: int = 0,
        hidden_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Feed ``input_ids`` ``[1, m]`` at ``position_ids`` ``[1, m]`` after the ``cache``'s positions; extend it.

        Args:
            position_ids: each below ``past + m`` (true of a chain after the cache and of
                a tree's depth-based positions).
            mask: a 4D additive mask ``[1, 1, m, past + m]``; None means causal (built here
                when m > 1; a single token attends to everything cached).
            last: return the logits of the last ``last`` rows only (0: every row).
            hidden_layers: also return these hidden states, indexed as the model's
                ``output_hidden_states`` (0 = embeddings, i = output of layer i, -1 = the
                final normed state), each ``[m, hidden]``; needs ``last=0``.

        Returns:
            logits ``[rows, vocab]`` in the model's dtype; with ``hidden_layers``, the
            pair ``(logits, {layer: hidden state})``.
        """
        mask, rotary = self._inputs(input_ids, cache, position_ids, mask)
        return self._layers(input_ids, cache, position_ids, mask, last, rotary, hidden_layers)

    def _inputs(self, input_ids, cache, position_ids, mask) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]:
        """The call's mask (causal when none is given and several rows come) and rotary ``(cos, sin)``."""
        rows, past = input_ids.shape[1], cache.get_seq_length()
        if mask is None and rows > 1:
            mask = causal_mask(past, rows, self.dtype, input_ids.device)
        return mask, self._rotary(position_ids, past + rows)

    def _layers(self, input_ids, cache, position_ids, mask, last, rotary, hidden_layers=()):
        """embed -> layers -> norm -> head, given the mask and the rotary ``(cos, sin)``: what ``compiled`` compiles."""
        hidden = self.embed(input_ids)
        states = [hidden]  # output_hidden_states' numbering: references only, nothing is copied
        for index, layer in enumerate(self.layers):
            if self.fused is not None:
                hidden = self.fused(index, hidden, mask, cache, rotary)
            else:
                kwargs = {"position_ids": position_ids, "cache": cache, "use_cache": True, "position_embeddings": rotary}
                hidden = layer(hidden, attention_mask=mask, **kwargs)
            states.append(hidden)
        if last:
            hidden = hidden[:, -last:]
        states[-1] = self.norm(hidden)
        logits = self.head(states[-1])[0]
        if not hidden_layers:
            return logits
        assert not last, "hidden states are returned for every row"
        return logits, {layer: states[layer][0] for layer in hidden_layers}

    def _rotary(self, position_ids: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary ``(cos, sin)`` ``[1, m, dim]`` of ``position_ids`` (all below ``bound``): table rows, or the module's own call."""
        like = self.head.weight  # the module reads only its device and dtype
        if not self.static_rotary:
            return self.rotary(like, position_ids=position_ids)
        if self.rotary_table is None or self.rotary_table[0].shape[0] < bound:
            size = max(bound, 2 * self.rotary_table[0].shape[0] if self.rotary_table is not None else 256)
            cos, sin = self.rotary(like, position_ids=torch.arange(size, device=like.device)[None])
            self.rotary_table = (cos[0], sin[0])
        index = position_ids[0]
        return self.rotary_table[0].index_select(0, index)[None], self.rotary_table[1].index_select(0, index)[None]

    def compiled(self) -> Callable[..., torch.Tensor]:
        """This forward with its layers through ``torch.compile`` (inductor, dynamic shapes): one graph per input kind.

        Run it under ``forward_mode(compiled=True)``: inductor cannot compile dynamic shapes
        of inference-mode tensors. The rotary lookup stays outside the graph, so the table
        (and its growth) never enters a guard. The first calls of each kind (one token,
        several, a tree mask) compile, seconds each. Over the layers' modules it halved
        the demo target's step on a CPU core; over the fused layers it takes 5-10% off
        (``benchmarks/bench_compile.py``).
        """
        graphs: dict[tuple[bool, bool], Callable] = {}

        def forward(input_ids, cache, position_ids, mask=None, last=0, hidden_layers=()):
            mask, rotary = self._inputs(input_ids, cache, position_ids, mask)  # outside the graph: every several-row call is one kind
            kind = (input_ids.shape[1] == 1, mask is None, tuple(hidden_layers))
            if kind not in graphs:
                graphs[kind] = self._compile_copy()
            try:
                out = graphs[kind](input_ids, cache, position_ids, mask, 0, rotary, kind[2])  # every row: one graph whatever ``last``
            except (AssertionError, torch._dynamo.exc.TorchDynamoException) as error:
                # Raised while compiling, before the graph ran: nothing was written yet.
                logger.warning("compiling the lean forward (%s rows, mask: %s) failed, it runs eagerly: %s", *_describe(kind), error)
                graphs[kind] = self._layers
                out = self._layers(input_ids, cache, position_ids, mask, 0, rotary, kind[2])
            if hidden_layers:
                return out
            return out[-last:] if last else out

        return forward

    def _compile_copy(self) -> Callable:
        """``_layers`` compiled from its own copy of the code.

        Dynamo keeps its graphs per code object and recompiles when a call breaks a guard
        (a draft's call after a target's, one row after several, a mask after none); in
        torch 2.13 such recompiles of these forwards fail now and then while building
        guards. So every model and input kind (one row or several, with or without a
        mask) gets a code object of its own, compiled once, with dynamic lengths.
        """
        function = LeanForward._layers
        own = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__, function.__defaults__)
        return torch.compile(types.MethodType(own, self), dynamic=True)

    @classmethod
    @torch.inference_mode()
    def probe(cls, model: nn.Module, atol: float | None = None) -> LeanForward | None:
        """A ``LeanForward`` for ``model`` when it reproduces the model's logits on a probe; else None.

        The probe prefills two tokens with the model, then feeds one token unmasked and
        three with a causal mask through the lean path, and compares every row with one
        forward of the whole input. A model with another layout, an attention that needs
        its own masks (sliding windows, flash kernels) or extra work in its forward
        (logit soft-capping) fails the probe and keeps its own forward. The fused layers
        (``FusedLayers``, where the layer kind is known) are probed first, then the
        layers' own modules.
        """
        if getattr(model.config, "_attn_implementation", None) not in ATTENTION_IMPLEMENTATIONS:
            return None
        if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers):
            return None  # sliding windows mask beyond what a short probe can show
        try:
            lean = cls(model)
            vocab = model.get_input_embeddings().num_embeddings
            ids = (torch.arange(PROBE_TOKENS, device=model.device) * 7919 % vocab).unsqueeze(0)
            expected = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits[0].float()
        except Exception:  # another layout or signature: the wrapper it is
            return None
        if atol is None:
            atol = 1e-4 if model.dtype == torch.float32 else 3e-2
        scale = max(1.0, float(expected.abs().max()))
        fused = _shared_fused(model, lean.layers) if os.environ.get(FUSED_SWITCH, "1") != "0" else None
        for candidate in ([fused] if fused is not None else []) + [None]:
            lean.fused = candidate
            try:
                cache = DynamicCache(config=model.config)
                model(ids[:, :2], cache=cache, use_cache=True)
                positions = torch.arange(PROBE_TOKENS, device=model.device).unsqueeze(0)
                single = lean(ids[:, 2:3], cache, positions[:, 2:3])
                several = lean(ids[:, 3:], cache, positions[:, 3:])
                got = torch.cat([single, several]).float()
            except Exception:
                continue
            if bool(((got - expected[2:]).abs() <= atol * scale).all()):
                return lean
        return None


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its compiled lean forward
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its fused layers (or None: not fusable)


def _shared_fused(model: nn.Module, layers: list[nn.Module]) -> FusedLayers | None:
    """``FusedLayers.build(layers)`` once per model: every decoder and proposer of a model shares one copy of the fused weights."""
    if model not in _FUSED:
        _FUSED[model] = FusedLayers.build(layers)
    return _FUSED[model]


def shared_compiled(model: nn.Module, lean: LeanForward) -> Callable[..., torch.Tensor]:
    """``lean.compiled()`` once per model: every decoder and proposer of a model shares its graphs, so each kind compiles once per process.

    The compiled forward holds the model's submodules, never the model itself, so the
    entry goes when the model does.
    """
    forward = _COMPILED.get(model)
    if forward is None:
        forward = _COMPILED[model] = lean.compiled()
    return forward


def _describe(kind: tuple) -> tuple[str, str]:
    return ("1" if kind[0] else "several", "none" if kind[1] else "yes")


@dataclass(frozen=True)
class FastPaths:
    """What a model decodes through (``fast_paths``).

    Args:
        preallocate: its KV cache lives in ``proposers.core.cache`` buffers.
        lean: its ``LeanForward``, or None (the model's own forward).
        compiled: ``forward`` is the compiled lean forward (decode under ``forward_mode(True)``).
        forward: what scores tokens: the compiled or plain lean forward, or None.
    """

    preallocate: bool
    lean: LeanForward | None
    compiled: bool
    forward: Callable[..., torch.Tensor] | None


def fast_paths(model: nn.Module, role: str, preallocated_cache: bool | None, lean_forward: bool | None, compile: bool) -> FastPaths:
    """The fast paths ``model`` may take, each probed (None: on unless ``DRAFTSMITH_FAST_PATHS=0``; ``compile`` off unless asked)."""
    preallocate = fast_path_enabled(preallocated_cache) and cache_probe_passes(model, role)
    lean = LeanForward.probe(model) if fast_path_enabled(lean_forward) else None
    compiled = compile and compile_possible(lean, preallocate, role)
    return FastPaths(preallocate, lean, compiled, shared_compiled(model, lean) if compiled else lean)


def compile_possible(lean: LeanForward | None, preallocated: bool, role: str) -> bool:
    """Whether a ``compile`` request can be honoured: it compiles the lean forward over a preallocated cache; logs why not."""
    if lean is None or not preallocated:
        missing = "lean forward" if lean is None else "preallocated cache"
        logger.warning(
            "%s: compile ignored: it compiles the lean forward over a preallocated cache; the %s is off or failed its probe", role, missing
        )
        return False
    return True


def forward_mode(compiled: bool) -> contextlib.AbstractContextManager:
    """The autograd mode to decode in: inference mode, or plain no-grad for compiled forwards (see ``LeanForward.compiled``)."""
    return _no_grad_outside_inference_mode() if compiled else torch.inference_mode()


@contextlib.contextmanager
def _no_grad_outside_inference_mode():
    with torch.inference_mode(False), torch.no_grad():
        yield


def causal_mask(past: int, rows: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """The 4D additive mask ``[1, 1, rows, past + rows]`` of ``rows`` new tokens after ``past`` cached ones."""
    mask = torch.zeros(1, 1, rows, past + rows, dtype=dtype, device=device)
    mask[..., past:] = torch.full((rows, rows), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask
