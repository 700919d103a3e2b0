"""The target model: prefill, score a draft tree in one forward, commit the accepted path.

Wraps a stock ``AutoModelForCausalLM``; the tree goes in as a 4D additive attention mask
with depth-based position ids, never through a patched modeling file. The cache always
holds every committed token but the last: that one (the *root*) is fed with the draft,
so the root's logits, which verify the draft's first level, come from the same forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from draftsmith.proposers.core.cache import compact_cache, crop_cache, make_cache
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.lean_forward import LEAN_MAX_ROWS, LeanForward
from draftsmith.proposers.core.models import check_full_attention, context_limit, load_causal_lm, load_tokenizer, output_vocab_size
from draftsmith.proposers.core.tree import tree_attention_mask, tree_position_ids
from draftsmith.proposers.core.types import Draft, TargetFeatures

TARGET_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class TargetOutput:
    """Logits (and optional hidden states) for the positions a forward scored.

    Args:
        logits: ``[num_positions, vocab]``.
        features: the requested hidden states, or None when no layer was requested.
    """

    logits: torch.Tensor
    features: TargetFeatures | None


class Target:
    """One request's view of the target model and its KV cache.

    Args:
        model: a causal LM in eval mode with full-attention layers only (``check_full_attention``:
            committing a tree slices each layer's keys and values, which a sliding-window
            layer cannot undo).
        hidden_layers: indices into the model's ``output_hidden_states`` tuple to return
            (0 = embeddings, i = output of layer i, -1 = the final normed state).
        preallocate: keep the cache in ``proposers.core.cache`` buffers.
        lean: the model's lean forward (``LeanForward``, or its ``compiled()`` form) for
            scoring; None: the model's own forward.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        hidden_layers: tuple[int, ...] = (),
        preallocate: bool = False,
        lean: LeanForward | Callable[..., torch.Tensor] | None = None,
    ):
        check_full_attention(model, "target")
        self.model = model
        self.device = model.device  # read once: the property walks the parameters
        head = model.get_output_embeddings()
        # where the logits come out (the last shard of a model split over devices): the verifier draws there
        self.output_device = head.weight.device if head is not None else self.device
        self.hidden_layers = tuple(hidden_layers)
        self.preallocate, self.lean = preallocate, lean
        self.vocab_size = output_vocab_size(model)
        self.max_positions = context_limit(model)  # None: no limit stated
        self.cache: DynamicCache | None = None
        self._scored_past = 0  # cache length before the last score()
        self._scored_chain = True

    @property
    def cache_len(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def prefill(self, input_ids: torch.Tensor, capacity: int = 0) -> TargetOutput:
        """Run the prompt ``[1, T]``; return the last position's logits ``[1, vocab]``.

        Args:
            capacity: positions to preallocate the cache for (when ``preallocate``; it grows if exceeded).
        """
        self.cache = make_cache(self.model, capacity if self.preallocate else 0)
        out = self.model(input_ids, cache=self.cache, use_cache=True, output_hidden_states=bool(self.hidden_layers), logits_to_keep=1)
        return self._output(out)

    def score(self, root_token: int, draft: Draft) -> TargetOutput:
        """Score root + draft in one forward; return logits ``[n + 1, vocab]``.

        Row 0 is the distribution after the root (the last committed token), row i + 1
        the distribution after draft node i.
        """
        past = self.cache_len
        device = self.device
        input_ids = torch.tensor([[root_token, *draft.token_list]], device=device)  # one copy: the host has the tokens
        self._scored_past = past
        self._scored_chain = draft.is_chain()
        if self._scored_chain:  # plain causal attention: no mask to build here
            return self._forward(input_ids, None, torch.arange(past, past + input_ids.shape[1], device=device)[None])
        parents = draft.parent_list
        mask = tree_attention_mask(parents, past, dtype=self.model.dtype, device=device)
        return self._forward(input_ids, mask, tree_position_ids(parents, past, device=device, depths=draft.depth_list))

    def commit(self, accepted_nodes: list[int]) -> None:
        """Keep the root and the accepted nodes in the cache; drop every other scored entry."""
        past = self._scored_past
        if self._scored_chain:  # the accepted nodes directly follow the root
            crop_cache(self.cache, past + 1 + len(accepted_nodes))
            return
        compact_cache(self.cache, past + 1, [past + 1 + node for node in accepted_nodes])

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor) -> TargetOutput:
        """Score ``input_ids`` ``[1, m]`` at ``position_ids`` with ``mask`` (None: causal) after the cache; extend it."""
        if self.lean is not None and input_ids.shape[1] <= LEAN_MAX_ROWS:
            if not self.hidden_layers:
                return TargetOutput(self.lean(input_ids, self.cache, position_ids, mask), None)
            logits, states = self.lean(input_ids, self.cache, position_ids, mask, hidden_layers=self.hidden_layers)
            return TargetOutput(logits, TargetFeatures(states))
        kwargs = {"attention_mask": mask, "position_ids": position_ids} if mask is not None else {}
        return self._output(
            self.model(input_ids, cache=self.cache, use_cache=True, output_hidden_states=bool(self.hidden_layers), **kwargs)
        )

    def _output(self, out) -> TargetOutput:
        features = None
        if self.hidden_layers:
            features = TargetFeatures({i: out.hidden_states[i][0] for i in self.hidden_layers})
        return TargetOutput(out.logits[0], features)


def load_target(path: str | Path, dtype: str | torch.dtype = torch.float32, device_map: str | dict | None = None):
    """Load a local causal LM and its tokenizer in eval mode; clear errors for a bad directory.

    A missing directory, config or tokenizer is a ``FileNotFoundError``; a broken
    ``config.json`` (invalid JSON, no ``model_type``), a truncated or corrupt weights file
    or a broken tokenizer file is one ``InputError`` line naming the file.

    Args:
        path: a ``save_pretrained`` directory holding the model and its tokenizer.
        dtype: ``torch.float32`` (default), ``bfloat16`` or ``float16`` (or their names).
        device_map: passed to ``from_pretrained`` to shard a large model over the devices
            (``"auto"``, or a module -> device mapping); None loads it whole on the CPU.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target directory {path} has no config.json (expected a save_pretrained model directory)")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"target directory {path} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    if isinstance(dtype, str):
        if dtype not in TARGET_DTYPES:
            raise InputError(f"target dtype {dtype!r} is not one of {list(TARGET_DTYPES)}")
        dtype = getattr(torch, dtype)
    model = load_causal_lm(path, "target", dtype=dtype, device_map=device_map)
    tokenizer = load_tokenizer(path, "target")
    return model, tokenizer
