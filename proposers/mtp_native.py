"""The MTP modules a model checkpoint ships, read from its safetensors files.

transformers drops these weights when it loads the model, so they are read from the
checkpoint's files directly and renamed to ``proposers.mtp_head``'s modules. Layouts (the
engines' own names; the config announces the modules in ``num_nextn_predict_layers``, or
``mtp_num_hidden_layers``):

- ``deepseek_v3`` (also GLM-4.5 ``glm4_moe``): module i is decoder layer
  ``model.layers.{N + i}`` (N = ``num_hidden_layers``) with ``enorm``, ``hnorm``,
  ``eh_proj`` (over ``[enorm(embedding), hnorm(hidden)]``) and ``shared_head.norm``;
- ``qwen3_next``: one ``mtp.`` prefix: ``mtp.pre_fc_norm_embedding``,
  ``mtp.pre_fc_norm_hidden``, ``mtp.fc``, ``mtp.norm``, blocks ``mtp.layers.{i}``;
- ``mimo``: ``model.mtp_layers.{i}`` with ``token_layernorm``, ``hidden_layernorm``,
  ``input_proj`` (over ``[hidden, embedding]``: its halves are swapped on load) and
  ``final_layernorm``.

``mimo_checkpoint`` writes the other way: a Llama or Qwen2 target with draftsmith's modules
in MiMo's layout, the one dense layout vLLM serves MTP from (``MtpProposer.export``).

The block must be Llama-style (``self_attn.{q,k,v,o}_proj``, optional q / k / v biases,
``mlp.{gate,up,down}_proj``): a block with MLA attention or MoE experts (DeepSeek-V3's
own) is refused, naming the tensors draftsmith cannot run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .core.checkpoint import CONFIG
from .core.errors import InputError
from .core.models import saved_tensors
from .mtp_head import MtpModules, config_for_target, modules_for_target

BLOCK = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
#: layout -> (module i's prefix, its own names -> ours, names shared by every module -> ours, hidden first in the projection)
LAYOUTS = {
    "deepseek_v3": (
        "model.layers.{n}.",
        {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "shared_head.norm"},
        {},
        False,
    ),
    "qwen3_next": (
        "mtp.layers.{i}.",
        {},
        {"mtp.pre_fc_norm_embedding": "enorm", "mtp.pre_fc_norm_hidden": "hnorm", "mtp.fc": "eh_proj", "mtp.norm": "shared_head.norm"},
        False,
    ),
    "mimo": (
        "model.mtp_layers.{i}.",
        {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "eh_proj", "final_layernorm": "shared_head.norm"},
        {},
        True,
    ),
}
MODEL_TYPES = {"deepseek_v3": "deepseek_v3", "glm4_moe": "deepseek_v3", "qwen3_next": "qwen3_next", "mimo": "mimo"}


def is_native(path: str | Path) -> bool:
    """Whether ``path`` is a model checkpoint whose config announces MTP modules (not modules ``MtpModules.save`` wrote)."""
    try:
        config = json.loads((Path(path) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "draftsmith_mtp" not in config and any(config.get(key) for key in COUNT_KEYS)


def load_native(path: str | Path, target: nn.Module) -> MtpModules:
    """The MTP modules shipped in the checkpoint directory ``path`` (the target's own), for ``target``."""
    path = Path(path)
    config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    count = next(int(config[key]) for key in COUNT_KEYS if config.get(key))
    tensors = _Tensors(path)
    layout = _layout(config, tensors, path)
    prefix, own, shared, hidden_first = LAYOUTS[layout]
    base = int(config.get("num_hidden_layers", 0))
    modules = modules_for_target(config_for_target(target, count), target)
    wanted = modules.state_dict()
    state = {}
    for i in range(count):
        where = prefix.format(n=base + i, i=i)
        names = {f"{where}{name}.weight": f"layers.{i}.{ours}.weight" for name, ours in own.items()}
        names |= {f"{name}.weight": f"layers.{i}.{ours}.weight" for name, ours in shared.items()}
        names |= {f"{where}{name}": f"layers.{i}.{name}" for name in BLOCK + BIASES if f"layers.{i}.{name}" in wanted}
        unsupported = sorted(k for k in tensors if k.startswith(where) and re.search(r"(q_a_proj|kv_a_proj|experts|\.gate\.weight)", k))
        if unsupported:
            raise InputError(
                f"{path}: MTP module {i} has a block draftsmith cannot run (MLA attention or MoE experts: {unsupported[:3]}); "
                "only Llama-style blocks (q / k / v / o projections, a gated MLP) load"
            )
        missing = sorted(theirs for theirs in names if theirs not in tensors)
        if missing:
            raise InputError(
                f"{path}: the config announces {count} MTP module(s) ({layout} layout), but the weight files lack "
                f"{missing[:4]}{' ...' if len(missing) > 4 else ''}"
            )
        for theirs, ours in names.items():
            tensor = tensors[theirs].float()
            if hidden_first and ours.endswith("eh_proj.weight"):
                hidden, embed = tensor.chunk(2, dim=1)
                tensor = torch.cat([embed, hidden], dim=1)  # ours reads [embedding, hidden]
            if tuple(tensor.shape) != tuple(wanted[ours].shape):
                raise InputError(
                    f"{path}: {theirs} has shape {tuple(tensor.shape)}, the target's MTP module needs {tuple(wanted[ours].shape)}"
                )
            state[ours] = tensor
    modules.load_state_dict(state)
    return modules.eval()


SERVABLE_AS_QWEN2 = ("llama", "qwen2")


def mimo_checkpoint(modules: MtpModules, target: nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """``config.json`` and the tensors of ``target`` with ``modules`` in MiMo's layout (a Qwen2 with ``model.mtp_layers.{i}``).

    A Llama target becomes a Qwen2 with zero q / k / v biases (Qwen2's attention always
    has them), which computes the same function; other targets are refused.
    """
    config = target.config
    if config.model_type not in SERVABLE_AS_QWEN2 or getattr(config, "mlp_bias", False):
        raise InputError(
            f"MiMo's MTP layout is a Qwen2: a {config.model_type!r} target (mlp_bias={getattr(config, 'mlp_bias', False)}) "
            f"cannot be written in it; targets of types {list(SERVABLE_AS_QWEN2)} can"
        )
    values = {k: v for k, v in config.to_dict().items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp", "model_type")}
    values |= {"architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "num_nextn_predict_layers": modules.cfg.num_modules}
    values |= {"use_sliding_window": False, "max_window_layers": config.num_hidden_layers}
    tensors = dict(saved_tensors(target))
    _, own, _, _ = LAYOUTS["mimo"]
    theirs = {ours: name for name, ours in own.items()}
    for ours, tensor in saved_tensors(modules).items():
        i, name = re.fullmatch(r"layers\.(\d+)\.(.+)", ours).groups()
        part = name.removesuffix(".weight")
        if part == "eh_proj":
            embed, hidden = tensor.chunk(2, dim=1)
            tensor = torch.cat([hidden, embed], dim=1)  # MiMo reads [hidden, embedding]
        out = f"model.mtp_layers.{i}.{theirs[part]}.weight" if part in theirs else f"model.mtp_layers.{i}.{name}"
        tensors[out] = tensor.contiguous()
    for name in [n for n in tensors if re.search(r"\.self_attn\.[qkv]_proj\.weight$", n)]:  # target and module blocks alike
        tensors.setdefault(name.removesuffix(".weight") + ".bias", torch.zeros(tensors[name].shape[0]))
    return values, {name: t.detach().float().contiguous() if t.is_floating_point() else t for name, t in tensors.items()}


def _layout(config: dict, tensors: _Tensors, path: Path) -> str:
    kind = MODEL_TYPES.get(str(config.get("model_type", "")))
    if kind is None:  # by the names present
        if any(name.startswith("mtp.") for name in tensors):
            kind = "qwen3_next"
        elif any(name.startswith("model.mtp_layers.") for name in tensors):
            kind = "mimo"
        elif any(name.endswith(".enorm.weight") for name in tensors):
            kind = "deepseek_v3"
    if kind is None:
        raise InputError(
            f"{path}: the config announces MTP modules but no known layout holds them (DeepSeek-V3 / GLM-4.5 enorm / hnorm / eh_proj, "
            "Qwen3-Next mtp.*, MiMo model.mtp_layers.*)"
        )
    return kind


class _Tensors:
    """The checkpoint's tensor names (every safetensors file, one or shards), each read only when asked for."""

    def __init__(self, path: Path):
        self.files: dict[str, Path] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise InputError(f"{path}: no .safetensors weight files (MTP modules are read from them)")
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    self.files |= dict.fromkeys(handle.keys(), file)
            except (OSError, SafetensorError) as error:
                raise InputError(f"{file} cannot be read (truncated or corrupt): {error}") from error

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __iter__(self):
        return iter(self.files)

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self.files[name]), framework="pt") as handle:
            return handle.get_tensor(name)
