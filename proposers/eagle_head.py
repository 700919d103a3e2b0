"""The EAGLE draft head: its shape, its decoder layer, its checkpoints (``proposers.eagle`` drafts with it).

Everything here is the module itself, shared by the proposer and ``training.eagle``: the
config (``EagleConfig``), a Llama-style layer with an explicit mask and cache, ``fc``,
EAGLE-3's norm / LM head / vocabulary maps, and the checkpoint layout vLLM and SGLang
load (no embedding; EAGLE-1 has no LM head: both are the target's).

P-EAGLE (parallel drafting, as vLLM serves it with ``parallel_drafting``): an EAGLE-3 head
trained to draft ``parallel_depth`` depths in one forward. Depth 1 is the usual entry
(the root token, the feature before it); depths 2 .. K are mask entries at the next
positions, each reading the target's embedding of ``mask_token_id`` and the learned
``mask_hidden`` (a placeholder of the concatenated aux features, fused by ``fc`` like
them), attending causally to the context and to the mask entries before it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from .core.cache import PreallocatedLayer
from .core.checkpoint import CONFIG, WEIGHTS, check_fits_target, check_tensors, read_checkpoint, read_shape
from .core.draft_layers import MLP, Attention, RMSNorm, RotaryTable, cached_attention, layer_shape, linear
from .core.errors import InputError, check_integer
from .core.models import default_mask_token, output_vocab_size


@dataclass(frozen=True)
class EagleConfig:
    """The shape of an EAGLE draft (stored in ``config.json`` under ``draftsmith_eagle``).

    Args:
        version: 1 (EAGLE-1 / -2 head) or 3.
        hidden_size: the draft layer's width: the target's hidden size.
        target_hidden_size: the width of each target feature.
        target_num_layers: the target's decoder layers (aux ids are checked against it).
        aux_layers: the target layers read (``output_hidden_states`` ids; EAGLE-1: ``[-1]``).
        vocab_size: the target's vocabulary.
        draft_vocab_size: the draft LM head's vocabulary (EAGLE-3; EAGLE-1 uses the target's).
        num_heads, num_kv_heads, head_dim, intermediate_size: the layer's attention and MLP.
        rms_norm_eps, rope_theta: as the target's.
        parallel_depth: 0 for a head that drafts one depth per forward; K > 0 for a P-EAGLE
            head trained to draft K depths in one forward (EAGLE-3 only).
        mask_token_id: the token a parallel head's mask entries embed (P-EAGLE only).
    """

    version: int
    hidden_size: int
    target_hidden_size: int
    target_num_layers: int
    aux_layers: list[int]
    vocab_size: int
    draft_vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    parallel_depth: int = 0
    mask_token_id: int | None = None

    def __post_init__(self):
        if check_integer("parallel_depth", self.parallel_depth) < 0:
            raise InputError(f"parallel_depth must be >= 0 (0: a sequential head), got {self.parallel_depth}")
        if self.parallel_depth and self.version != 3:
            raise InputError("parallel drafting (P-EAGLE) is an EAGLE-3 option: version must be 3")
        if self.parallel_depth and not (
            isinstance(self.mask_token_id, int) and not isinstance(self.mask_token_id, bool) and 0 <= self.mask_token_id < self.vocab_size
        ):
            raise InputError(f"a parallel head needs a mask_token_id in [0, {self.vocab_size}), got {self.mask_token_id!r}")
        if not self.parallel_depth and self.mask_token_id is not None:
            raise InputError("mask_token_id is for parallel heads (parallel_depth > 0)")
        if self.version not in (1, 3):
            raise InputError(f"EAGLE version must be 1 or 3, got {self.version!r}")
        if self.version == 1 and list(self.aux_layers) != [-1]:
            raise InputError(f"EAGLE-1 reads the target's final state (aux_layers [-1]), got {list(self.aux_layers)}")
        if self.version == 3:
            check_aux_layers(self.aux_layers, self.target_num_layers)
        if self.num_heads % self.num_kv_heads:
            raise InputError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise InputError(f"draft_vocab_size must be in [1, {self.vocab_size}] (the target's vocabulary), got {self.draft_vocab_size}")
        if self.version == 1 and self.draft_vocab_size != self.vocab_size:
            raise InputError("EAGLE-1 scores with the target's LM head: draft_vocab_size must equal vocab_size")


def check_aux_layers(aux_layers, num_layers: int) -> None:
    """Raise InputError unless ``aux_layers`` are three distinct ids of layer outputs 1 .. num_layers - 1 (ascending)."""
    ids = list(aux_layers)
    if len(ids) != 3 or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InputError(f"aux_layers must be three layer ids (low, mid, high), got {ids!r}")
    if not all(1 <= i < num_layers for i in ids) or sorted(set(ids)) != ids:
        raise InputError(
            f"aux_layers {ids} must be ascending ids of layer outputs in [1, {num_layers - 1}] "
            f"(output_hidden_states numbering; the target has {num_layers} layers)"
        )


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high layers: ``[2, N // 2, N - 3]``; for shallow targets where those collide, ``[1, N // 2, N - 1]``."""
    for ids in ([2, num_layers // 2, num_layers - 3], [1, num_layers // 2, num_layers - 1]):
        if all(1 <= i < num_layers for i in ids) and sorted(set(ids)) == ids:
            return ids
    raise InputError(f"a target of {num_layers} layers has no three distinct aux layers (EAGLE-3 needs at least 4 layers)")


VOCABULARY_MAPS = ("d2t", "t2d")  # EAGLE-3's draft id -> target id offsets, and the target ids it drafts


# -- the draft layer -------------------------------------------------------------------


class DraftLayer(nn.Module):
    """One Llama-style decoder layer; EAGLE-3's reads ``concat(input_layernorm(embeds), hidden_norm(hidden))``.

    EAGLE-1's has no input norm (the first layer of EAGLE's draft skips it); its input is
    the ``fc`` output, which is also its residual.
    """

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        width = 2 * cfg.hidden_size if cfg.version == 3 else cfg.hidden_size
        self.self_attn = Attention(width, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.version == 3:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eagle3 = cfg.version == 3

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1) if self.eagle3 else hidden

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP: ``[batch, m, hidden]``."""
        hidden = residual + self.self_attn.out(attended)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleDraft(nn.Module):
    """An EAGLE draft: ``fc``, one ``DraftLayer``, and (EAGLE-3) its norm, LM head and vocabulary maps.

    Args:
        cfg: its shape.
        embed_weight: the target's input embedding ``[vocab, hidden]`` (shared, not a parameter).
        lm_head_weight: the target's LM head ``[vocab, hidden]`` (EAGLE-1 only; shared, not a parameter).
    """

    def __init__(self, cfg: EagleConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        fc_in = 2 * cfg.hidden_size if cfg.version == 1 else 3 * cfg.target_hidden_size
        self.fc = nn.Linear(fc_in, cfg.hidden_size, bias=False)
        self.layer = DraftLayer(cfg)
        self.shared = {"embed": embed_weight.detach(), "lm_head": lm_head_weight.detach() if lm_head_weight is not None else None}
        if cfg.version == 3:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
            # the identity map until set_vocabulary chooses the draft's tokens
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size)
        if cfg.parallel_depth:  # the mask entries' placeholder features, in the aux features' own space (vLLM's layout)
            self.mask_hidden = nn.Parameter(torch.zeros(fc_in))
        self._rotary = RotaryTable(cfg.head_dim, cfg.rope_theta)

    # -- vocabulary ----------------------------------------------------------------------

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Use the target tokens ``target_ids`` ``[draft_vocab]`` (ascending) as the draft vocabulary: fills ``d2t`` and ``t2d``."""
        target_ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
        assert target_ids.shape == (self.cfg.draft_vocab_size,)
        self.d2t.copy_(target_ids - torch.arange(self.cfg.draft_vocab_size))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    def draft_to_target(self) -> torch.Tensor:
        """``[draft_vocab]`` the target id of each draft id (``draft id + d2t``)."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    # -- pieces --------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.shared["embed"])

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the concatenated aux features ``[..., 3 * target_hidden]`` -> ``[..., hidden]``; EAGLE-1: unchanged."""
        return linear(self.fc, features) if self.cfg.version == 3 else features

    def mask_inputs(self, count: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """A parallel head's ``count`` mask entries: their tokens ``[batch, count]`` and fused features ``[batch, count, hidden]``."""
        tokens = torch.full((batch, count), self.cfg.mask_token_id, dtype=torch.long, device=self.fc.weight.device)
        return tokens, self.fuse(self.mask_hidden).expand(batch, count, -1)

    def layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) of a step from token embeddings and features ``[batch, m, hidden]``."""
        if self.cfg.version == 1:
            x = linear(self.fc, torch.cat([embeds, hidden], dim=-1))
            return x, x
        return self.layer.attention_input(embeds, hidden), hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., draft_vocab]`` of layer outputs (EAGLE-1: the target's LM head on them directly)."""
        if self.cfg.version == 1:  # the target's head, in the target's dtype (a bf16 / fp16 target's is not copied to fp32 per step)
            return F.linear(hidden.to(self.shared["lm_head"].dtype), self.shared["lm_head"])
        return linear(self.lm_head, self.norm(hidden))

    def rotary(self, positions: torch.Tensor | range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin ``[m, head_dim]`` of ``positions`` ``[m]`` (``RotaryTable``: a range or list saves a read)."""
        return self._rotary(positions, self.fc.weight.device)

    def step(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor | range | list[int],
        cache: PreallocatedLayer,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One inference step after the cache: outputs ``[1, m, hidden]``.

        Args:
            tokens: ``[1, m]``; hidden: ``[1, m, hidden]`` features; positions: ``[m]``.
            mask: additive ``[1, 1, m, cached + m]``; None is causal over the new rows.
        """
        x, residual = self.layer_input(self.embed(tokens), hidden)
        cos, sin = self.rotary(positions)
        attn = self.layer.self_attn
        q, k, v = attn.qkv(x, cos, sin)
        return self.layer.finish(residual, cached_attention(attn, q, k, v, cache, mask))

    # -- saving ----------------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """The draft's own tensors under the names its checkpoint uses (EAGLE-3: ``midlayer.*``; EAGLE-1: ``layers.0.*``).

        A head over the target's whole vocabulary has no ``d2t`` / ``t2d``: its maps are the
        identity, which engines assume, and vLLM refuses a ``d2t`` for such a head.
        """
        prefix = "midlayer." if self.cfg.version == 3 else "layers.0."
        identity_maps = self.cfg.version == 3 and self.cfg.draft_vocab_size == self.cfg.vocab_size
        out = {}
        for name, tensor in self.state_dict().items():
            if tensor is None or (identity_maps and name in VOCABULARY_MAPS):
                continue
            out[prefix + name.removeprefix("layer.") if name.startswith("layer.") else name] = tensor
        return out

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        """Write ``config.json`` and ``model.safetensors`` (no embedding; EAGLE-1: no LM head) into ``out_dir``."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in self.tensors().items()}
        save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
        (out_dir / CONFIG).write_text(json.dumps(checkpoint_config(self.cfg), indent=1) + "\n")


def checkpoint_config(cfg: EagleConfig) -> dict:
    """``config.json``: Llama fields an engine reads, the EAGLE-3 fields vLLM / SGLang read, and draftsmith's own copy of the shape."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3" if cfg.version == 3 else "EagleLlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.vocab_size,
        "draftsmith_eagle": asdict(cfg),
    }
    if cfg.version == 3:
        config |= {
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers)},
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
        }
    if cfg.parallel_depth:  # the id vLLM embeds for the mask slots of parallel drafting
        config["mask_token_id"] = cfg.mask_token_id
    return config


def read_head_config(path: str | Path) -> EagleConfig:
    """The shape of the EAGLE draft saved in ``path`` (``EagleDraft.save``); a missing or bad config is one clear error."""
    return read_shape(path, "draftsmith_eagle", EagleConfig, "EAGLE draft")


def load_draft(path: str | Path, target: nn.Module) -> EagleDraft:
    """Load an EAGLE draft written by ``EagleDraft.save`` for ``target``; a bad file or another target's head is one InputError line."""
    cfg = read_head_config(path)
    check_head_fits(cfg, target)
    draft = draft_for_target(cfg, target)
    checkpoint = read_checkpoint(path, "EAGLE draft")
    stored = dict(checkpoint.tensors)
    if cfg.version == 3 and cfg.draft_vocab_size == cfg.vocab_size:  # identity maps, written by earlier versions: checked, not kept
        maps = {name: stored.pop(name) for name in VOCABULARY_MAPS if name in stored}
        if ("d2t" in maps and bool(maps["d2t"].any())) or ("t2d" in maps and not bool(maps["t2d"].all())):
            raise InputError(f"{checkpoint.weights}: a head of the target's whole vocabulary has d2t / t2d that are not the identity")
    check_tensors(checkpoint.weights, stored, draft.tensors(), "EAGLE")
    renamed = {}
    for name, tensor in stored.items():
        for prefix in ("midlayer.", "layers.0."):
            if name.startswith(prefix):
                name = "layer." + name.removeprefix(prefix)
        renamed[name] = tensor.float() if tensor.is_floating_point() else tensor
    loaded = draft.load_state_dict(renamed, strict=False)  # a whole-vocabulary head keeps its identity maps as built
    assert set(loaded.missing_keys) <= set(VOCABULARY_MAPS) and not loaded.unexpected_keys, loaded
    if cfg.version == 3:
        check_vocabulary_maps(draft, checkpoint.weights)
    return draft.eval()


def check_vocabulary_maps(draft: EagleDraft, where) -> None:
    """Raise InputError unless ``d2t`` maps the draft vocabulary onto distinct target ids and ``t2d`` marks exactly them."""
    cfg = draft.cfg
    if draft.d2t.shape != (cfg.draft_vocab_size,) or draft.t2d.shape != (cfg.vocab_size,):
        raise InputError(f"{where}: d2t must have {cfg.draft_vocab_size} entries and t2d {cfg.vocab_size}")
    ids = draft.draft_to_target()
    if ids.min() < 0 or ids.max() >= cfg.vocab_size or ids.unique().numel() != ids.numel():
        raise InputError(f"{where}: d2t maps draft ids outside [0, {cfg.vocab_size}) or onto the same target id twice")
    if int(draft.t2d.sum()) != cfg.draft_vocab_size or not bool(draft.t2d[ids].all()):
        raise InputError(f"{where}: t2d does not mark exactly the target ids d2t maps to")


def check_head_fits(cfg: EagleConfig, target: nn.Module) -> None:
    """Raise InputError unless a draft of shape ``cfg`` reads ``target``'s features and scores its vocabulary."""
    check_fits_target("EAGLE draft", target, cfg.target_hidden_size, cfg.target_num_layers, cfg.vocab_size)


def draft_for_target(cfg: EagleConfig, target: nn.Module) -> EagleDraft:
    """A draft of shape ``cfg`` sharing ``target``'s embedding (and, for EAGLE-1, its LM head)."""
    lm_head = target.get_output_embeddings().weight if cfg.version == 1 else None
    draft = EagleDraft(cfg, target.get_input_embeddings().weight, lm_head)
    return draft.to(target.device)


def config_for_target(
    target: nn.Module,
    version: int,
    aux_layers: list[int] | None = None,
    draft_vocab_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    parallel_depth: int = 0,
    mask_token_id: int | None = None,
) -> EagleConfig:
    """The EAGLE shape for ``target``: its hidden size, positions' rotary, heads and vocabulary unless given.

    A parallel head (``parallel_depth`` > 0) embeds ``mask_token_id`` for its mask entries (default: the target's pad token).
    """
    hidden = target.config.hidden_size
    vocab = output_vocab_size(target)
    layers = int(target.config.num_hidden_layers)
    return EagleConfig(
        version=version,
        hidden_size=hidden,
        target_hidden_size=hidden,
        target_num_layers=layers,
        aux_layers=[-1] if version == 1 else list(aux_layers or default_aux_layers(layers)),
        vocab_size=vocab,
        draft_vocab_size=vocab if version == 1 else (draft_vocab_size or vocab),
        parallel_depth=parallel_depth,
        mask_token_id=(default_mask_token(target) if mask_token_id is None else mask_token_id) if parallel_depth else None,
        **layer_shape(target, num_heads, num_kv_heads, intermediate_size),
    )
