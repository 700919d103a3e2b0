"""Llama-style building blocks of the small draft heads (EAGLE's layer, MTP's modules).

An RMSNorm, rotary embedding from a table, attention with an explicit mask over a
``PreallocatedLayer`` cache, a SiLU-gated MLP. Training runs them as modules, so autograd
sees every projection; drafting (autograd off) stacks q / k / v and gate / up into one
matmul each (``FusedCopy``) and calls the small projections without a module call: for a
layer this small on a CPU, each op's dispatch costs about as much as its math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cache import PreallocatedLayer


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32, the weight applied inside the kernel: one op instead of four
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; without autograd its weights straight into ``F.linear`` (a module call costs more than a small matmul)."""
    return module(x) if torch.is_grad_enabled() else F.linear(x, module.weight, module.bias)


class FusedCopy:
    """The weights (and biases) of some ``nn.Linear``s stacked into one, for matmuls without autograd.

    The copy is rebuilt whenever one of the tensors changed since it was taken: moved
    (another data pointer) or updated in place (an optimizer step bumps its version), so a
    head that is still training drafts with its current weights. It is not a module
    attribute of its own: ``state_dict`` and checkpoints never see it.
    """

    def __init__(self, linears: tuple[nn.Linear, ...]):
        self.linears = linears
        self.key: tuple | None = None
        self.value: tuple[torch.Tensor, torch.Tensor | None] = (torch.empty(0), None)

    def get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight, bias)``: the stacked weights ``[sum of outputs, inputs]`` and biases (None when they have none)."""
        tensors = [t for linear in self.linears for t in (linear.weight, linear.bias) if t is not None]
        # inference tensors (a head built under inference mode) keep no version: they cannot be trained
        key = tuple((t.data_ptr(), 0 if t.is_inference() else t._version, t.dtype) for t in tensors)
        if key != self.key:
            with torch.no_grad():
                weight = torch.cat([linear.weight.detach() for linear in self.linears])
                biases = [linear.bias for linear in self.linears]
                bias = None
                if any(b is not None for b in biases):  # a projection without a bias adds zeros
                    bias = torch.cat(
                        [
                            b.detach() if b is not None else lin.weight.new_zeros(lin.out_features)
                            for b, lin in zip(biases, self.linears, strict=True)
                        ]
                    )
            self.key, self.value = key, (weight, bias)
        return self.value


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021) of ``x`` ``[..., m, d]`` with ``cos`` / ``sin`` ``[m, d]`` (halves rotated)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RotaryTable:
    """cos / sin rows of rotary positions, from a table computed once and doubled as needed (one copy per device)."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta = head_dim, theta
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, positions: torch.Tensor | range | list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin ``[m, head_dim]`` on ``device`` of ``positions`` ``[m]``.

        Positions the host knows (a ``range`` or a list: what decoding has) size the table
        without a read of a device tensor; a tensor (training's) is read once for its largest.
        """
        if isinstance(positions, torch.Tensor):
            bound = int(positions.max()) + 1 if positions.numel() else 1
        else:
            bound = max(positions, default=0) + 1
        if self.table is None or self.table[0].shape[0] < bound:
            size = max(bound, 2 * self.table[0].shape[0] if self.table is not None else 512)
            inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
            angles = torch.outer(torch.arange(size, dtype=torch.float32), inv)
            angles = torch.cat([angles, angles], dim=-1)
            self.table, self._on = (angles.cos(), angles.sin()), {}
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = (self.table[0].to(device), self.table[1].to(device))
        cos, sin = self._on[device]
        if isinstance(positions, range) and positions.step == 1:
            return cos[positions.start : positions.stop], sin[positions.start : positions.stop]
        if not isinstance(positions, torch.Tensor):
            positions = torch.tensor(list(positions), dtype=torch.long, device=device)
        return cos.index_select(0, positions), sin.index_select(0, positions)


def cached_attention(
    attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PreallocatedLayer, mask: torch.Tensor | None
) -> torch.Tensor:
    """Append k / v to ``cache`` and attend with q over all of it; ``mask`` None is causal over the new rows."""
    keys, values = cache.update(k, v)
    keys, values = attn.expand_kv(keys), attn.expand_kv(values)
    if mask is None and q.shape[2] > 1:
        past = keys.shape[2] - q.shape[2]
        mask = torch.zeros(q.shape[2], keys.shape[2], dtype=q.dtype, device=q.device)
        mask[:, past:] = torch.full((q.shape[2], q.shape[2]), float("-inf"), device=q.device).triu(1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class Attention(nn.Module):
    """Llama-style attention projections; with ``qk_norm_eps``, Qwen3-style per-head RMSNorms of q and k before the rotation."""

    def __init__(
        self, input_width: int, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False, qk_norm_eps: float | None = None
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(input_width, heads * head_dim, bias=bias)  # q / k / v biases: Qwen2-style blocks
        self.k_proj = nn.Linear(input_width, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(input_width, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.qk_norm = qk_norm_eps is not None
        self._fused = FusedCopy((self.q_proj, self.k_proj, self.v_proj))
        self._fused_kv = FusedCopy((self.k_proj, self.v_proj))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[batch, m, width]`` -> rotated q ``[batch, heads, m, d]``, k and v ``[batch, kv_heads, m, d]``.

        Without autograd (drafting) one matmul over the three projections and one rotation
        of q and k together: the same values in about a third of the tensor ops (for a
        small draft layer on a CPU, each op's dispatch costs about as much as its math).
        """
        batch, m, _ = x.shape
        if not torch.is_grad_enabled():
            heads, rotated = self.heads, self.heads + self.kv_heads
            qkv = F.linear(x, *self._fused.get()).view(batch, m, rotated + self.kv_heads, self.head_dim).transpose(1, 2)
            if self.qk_norm:
                q, k = rotate(self.q_norm(qkv[:, :heads]), cos, sin), rotate(self.k_norm(qkv[:, heads:rotated]), cos, sin)
                return q, k, qkv[:, rotated:]
            qk = rotate(qkv[:, :rotated], cos, sin)
            return qk[:, :heads], qk[:, heads:], qkv[:, rotated:]
        q = self.q_proj(x).view(batch, m, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, m, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, m, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (and normed) k and v ``[batch, kv_heads, m, d]`` of ``x`` ``[batch, m, width]``, without q (keys a cache holds)."""
        batch, m, _ = x.shape
        if torch.is_grad_enabled():
            k = self.k_proj(x).view(batch, m, self.kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(batch, m, self.kv_heads, self.head_dim).transpose(1, 2)
        else:
            k, v = F.linear(x, *self._fused_kv.get()).view(batch, m, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        return rotate(self.k_norm(k) if self.qk_norm else k, cos, sin), v

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        """``[batch, heads, m, d]`` -> ``[batch, m, hidden]``."""
        batch, _, m, _ = attended.shape
        return linear(self.o_proj, attended.transpose(1, 2).reshape(batch, m, self.heads * self.head_dim))

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        repeat = self.heads // self.kv_heads
        return t if repeat == 1 else t.repeat_interleave(repeat, dim=1)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._fused = FusedCopy((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # drafting: gate and up in one matmul
            gate, up = F.linear(x, self._fused.get()[0]).chunk(2, dim=-1)
            return F.linear(F.silu(gate).mul_(up), self.down_proj.weight)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def layer_shape(
    target: nn.Module, num_heads: int | None = None, num_kv_heads: int | None = None, intermediate_size: int | None = None
) -> dict:
    """A draft layer as wide as ``target``'s: its heads, head size, MLP width, norm epsilon and rotary base, unless given."""
    tc = target.config
    hidden = tc.hidden_size
    heads = num_heads or tc.num_attention_heads
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    return {
        "num_heads": heads,
        "num_kv_heads": num_kv_heads or getattr(tc, "num_key_value_heads", None) or heads,
        "head_dim": getattr(tc, "head_dim", None) or hidden // heads,
        "intermediate_size": intermediate_size or getattr(tc, "intermediate_size", 4 * hidden),
        "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
        "rope_theta": float(theta),
    }
