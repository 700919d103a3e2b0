"""A preallocated KV cache: keys and values written in place, rolled back by moving a length.

transformers' ``DynamicCache`` concatenates each forward's keys and values onto the cache,
copying every layer's whole cache per step: measured on the demo target, half of the
growth of a decode step's cost with the context. ``PreallocatedLayer`` is a cache layer of
transformers' own interface (``DynamicLayer`` subclass): it writes into a buffer allocated
once per request (doubled when it runs out) and hands the model the filled prefix as
views. A crop is a slice of that prefix; a tree commit moves the accepted entries down in
place (``compact``). Models reach it through their own ``Cache.update``: nothing is patched.

``probe`` runs a model both ways on a short script (a prefill, a chain, a crop, a tree, a
commit) and returns the reason they differ, or None; callers fall back to a
``DynamicCache`` with that reason logged.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .tree import tree_attention_mask, tree_position_ids

logger = logging.getLogger(__name__)
PROBE_TOKENS = 8
#: Positions preallocated beyond what a request is known to need (its prompt, or prompt and output), for
#: draft nodes and, in a draft's own cache, the output; more grows the buffer (one copy, doubled).
CACHE_HEADROOM = 256


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values ``[batch, heads, capacity, head_dim]``, filled from the start.

    ``keys`` / ``values`` are always views of the filled prefix, so every reader of a
    ``DynamicLayer`` (sequence length, mask sizes, ``crop_cache``) works unchanged.

    Args:
        capacity: positions to allocate at the first update (doubled when exceeded).
    """

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = max(int(capacity), 1)
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None
        self.length = 0  # filled positions; compiled code reads this, not the views (see update)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.key_buffer = self._allocate(key_states, self.capacity)
        self.value_buffer = self._allocate(value_states, self.capacity)
        self.keys, self.values = self.key_buffer[..., :0, :], self.value_buffer[..., :0, :]
        self.length = 0
        self.is_initialized = True

    @staticmethod
    def _allocate(like: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads, _, dim = like.shape
        return torch.empty(batch, heads, capacity, dim, dtype=like.dtype, device=like.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[batch, heads, m, dim]`` after the filled prefix, in place; return the new prefix views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # Compiled code reads the buffers and ``length`` only: the views as graph inputs
        # (aliasing their buffers) make dynamo fail while building guards, and the
        # data-pointer test of ``_own_prefix`` breaks the graph. Only draftsmith's own crop /
        # compact touch the cache between compiled calls, and they keep ``length``.
        if not torch.compiler.is_compiling():
            self._own_prefix()  # also brings ``length`` up to date
        length = self.length
        added = key_states.shape[-2]
        if length + added > self.key_buffer.shape[-2]:
            self._grow(length + added, length)
        self.key_buffer[..., length : length + added, :].copy_(key_states)
        self.value_buffer[..., length : length + added, :].copy_(value_states)
        self.length = length + added
        self.keys = self.key_buffer[..., : length + added, :]
        self.values = self.value_buffer[..., : length + added, :]
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` filled positions (a crop: the views shrink, nothing moves)."""
        if self.is_initialized and self.keys.shape[-2] > length:
            self.keys, self.values = self.keys[..., :length, :], self.values[..., :length, :]
            self.length = length

    def compact(self, prefix_len: int, kept: list[int]) -> None:
        """Keep the first ``prefix_len`` positions, then the positions ``kept`` (ascending), moved down in place."""
        self._own_prefix()
        if kept:
            index = torch.tensor(kept, dtype=torch.long, device=self.device)
            end = prefix_len + len(kept)
            # kept positions are >= their destinations, so the gathered copy is taken before any write lands
            self.key_buffer[..., prefix_len:end, :] = self.key_buffer.index_select(-2, index)
            self.value_buffer[..., prefix_len:end, :] = self.value_buffer.index_select(-2, index)
        self.keys = self.key_buffer[..., : prefix_len + len(kept), :]
        self.values = self.value_buffer[..., : prefix_len + len(kept), :]
        self.length = prefix_len + len(kept)

    def _grow(self, needed: int, length: int) -> None:
        capacity = max(needed, 2 * self.key_buffer.shape[-2])
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = self._allocate(old, capacity)
            new[..., :length, :] = old[..., :length, :]
            setattr(self, name, new)
        self.keys, self.values = self.key_buffer[..., :length, :], self.value_buffer[..., :length, :]

    def _own_prefix(self) -> None:
        """Bring ``keys`` / ``values`` back into the buffer if someone replaced them with other tensors."""
        if self.keys.data_ptr() != self.key_buffer.data_ptr() or self.keys.stride() != self.key_buffer.stride():
            keys, values = self.keys, self.values
            if keys.shape[-2] > self.key_buffer.shape[-2]:
                self.key_buffer, self.value_buffer = self._allocate(keys, 2 * keys.shape[-2]), self._allocate(values, 2 * keys.shape[-2])
            self.key_buffer[..., : keys.shape[-2], :] = keys
            self.value_buffer[..., : values.shape[-2], :] = values
            self.keys, self.values = self.key_buffer[..., : keys.shape[-2], :], self.value_buffer[..., : values.shape[-2], :]
        self.length = self.keys.shape[-2]

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        self.length = 0
        super().reset()


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of every layer of a ``transformers.DynamicCache``."""
    for layer in cache.layers:
        if hasattr(layer, "truncate"):  # a preallocated layer keeps its own length
            layer.truncate(length)
        elif layer.keys is not None and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def compact_cache(cache, prefix_len: int, kept: list[int]) -> None:
    """Keep the first ``prefix_len`` positions of a ``DynamicCache``, then the positions ``kept``, in that order.

    This drops the KV of a tree's rejected nodes. When ``kept`` directly continues the
    prefix it is a crop (views, no copy); otherwise one ``index_select`` per layer.
    """
    if kept == list(range(prefix_len, prefix_len + len(kept))):
        crop_cache(cache, prefix_len + len(kept))
        return
    device = cache.layers[0].keys.device
    keep = None
    for layer in cache.layers:
        if hasattr(layer, "compact"):  # a preallocated layer moves the kept entries down in place
            layer.compact(prefix_len, kept)
            continue
        if keep is None:
            keep = torch.cat([torch.arange(prefix_len), torch.tensor(kept, dtype=torch.long)]).to(device)
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)


def fast_path_enabled(choice: bool | None) -> bool:
    """A fast path (preallocated cache, lean forward) is on when asked, or by default unless ``DRAFTSMITH_FAST_PATHS=0``."""
    return choice if choice is not None else os.environ.get("DRAFTSMITH_FAST_PATHS", "1") != "0"


def cache_probe_passes(model: nn.Module, role: str) -> bool:
    """Whether ``model`` may use preallocated caches (``probe``); logs the reason when it may not."""
    reason = probe(model)
    if reason is not None:
        logger.warning("%s %s keeps transformers' DynamicCache: %s", role, type(model).__name__, reason)
    return reason is None


def make_cache(model: nn.Module, capacity: int = 0) -> DynamicCache:
    """A ``DynamicCache`` for ``model``; with ``capacity`` > 0 its layers are preallocated for that many positions."""
    cache = DynamicCache(config=model.config)
    if capacity > 0:
        cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
    return cache


@torch.inference_mode()
def probe(model: nn.Module, atol: float | None = None) -> str | None:
    """Why ``model`` cannot use ``PreallocatedLayer`` caches (logits differ from a ``DynamicCache``'s), or None when it can.

    The script: prefill 5 tokens, feed a chain of 3, crop one, feed a 3-node tree with its
    mask, commit one branch (``compact_cache``), feed one token; every step's logits compared.
    """
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(PROBE_TOKENS, device=model.device) * 7919 % vocab).tolist()
    if atol is None:
        atol = 1e-4 if model.dtype == torch.float32 else 3e-2
    results = []
    try:
        for capacity in (0, 4):  # 4 < what the script needs: growth is part of the probe
            results.append(_probe_script(model, make_cache(model, capacity), ids))
    except Exception as error:  # another cache protocol, another layout: the dynamic cache it is
        return f"the probe failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    for step, (expected, got) in enumerate(zip(*results, strict=True)):
        scale = max(1.0, float(expected.abs().max()))
        if expected.shape != got.shape or not bool(((got - expected).abs() <= atol * scale).all()):
            return f"logits differ from a DynamicCache's at probe step {step}"
    return None


def _probe_script(model: nn.Module, cache, ids: list[int]) -> list[torch.Tensor]:
    device, out = model.device, []

    def forward(tokens, **kwargs):
        logits = model(torch.tensor([tokens], device=device), cache=cache, use_cache=True, **kwargs).logits[0]
        out.append(logits.float())

    forward(ids[:5])
    forward(ids[5:8])  # a chain
    crop_cache(cache, 7)
    parents = [-1, 0, -1]  # a tree after the last committed token
    past = cache.get_seq_length()
    mask = tree_attention_mask(parents, past, dtype=model.dtype).to(device)
    forward([ids[6], ids[1], ids[2], ids[3]], attention_mask=mask, position_ids=tree_position_ids(parents, past).to(device))
    compact_cache(cache, past + 1, [past + 3])  # keep the root and node 2
    forward([ids[4]])
    return out
