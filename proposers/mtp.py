"""MTP: multi-token-prediction modules (DeepSeek-V3 style) as the draft.

Module d (1 .. D) reads the hidden state from depth d - 1 (the target's final hidden
state for d = 1) and the embedding of the token at depth d, normalises each (``hnorm``,
``enorm``), projects their concatenation (``eh_proj``) and runs one transformer block;
its output h_d, normalised (``shared_head.norm``) and scored by the target's LM head,
predicts the token at depth d + 1. The embedding and LM head are the target's.

At position p, module d reads token p + d and module d - 1's output at p, and attends to
its own entries at positions <= p, as it trained (``training.mtp``). So a step runs module
d over the committed positions it has not seen (a catch-up), then over the d - 1
positions whose tokens are the chain's own guesses; its last row gives the depth-d guess.
Those draft rows are dropped from its cache before the next step. With ``recursive``, the
depths past the last module reuse it one position further each time, reading its own
previous output (as engines do with a checkpoint that ships a single module).

A chain by default (each module's top-1 guess, a point mass; at T > 0 a sample with its
true draft distribution); with ``tree_width > 1`` a top-k (or sampled) tree through the
shared dynamic tree builder, whose node at depth d is scored by module d + 1 run over that
node's own path. The output is exact at every temperature.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .base import (
    Draft,
    InputError,
    ProposeContext,
    TargetFeatures,
    VerifyResult,
    check_integer,
    check_probability,
    logits_to_probs,
    output_vocab_size,
)
from .cache import PreallocatedLayer
from .draft_layers import MLP, Attention, RMSNorm, RotaryTable, cached_attention, layer_shape
from .engine import CONFIG, WEIGHTS, EngineExport, check_format, check_tensors, write_export, write_spec
from .tree import grow_dynamic_tree

CACHE_HEADROOM = 64
BIASED_ATTENTION = ("qwen2", "mimo")  # model types whose attention has q / k / v biases without saying so in the config


@dataclass(frozen=True)
class MtpConfig:
    """The shape of D MTP modules (``config.json``: ``num_nextn_predict_layers`` and draftsmith's copy under ``draftsmith_mtp``)."""

    hidden_size: int
    vocab_size: int
    num_modules: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False

    def __post_init__(self):
        for name in ("hidden_size", "vocab_size", "num_modules", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            if check_integer(name, getattr(self, name)) < 1:
                raise InputError(f"MTP {name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise InputError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


class SharedHead(nn.Module):
    def __init__(self, cfg: MtpConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MtpModule(nn.Module):
    """One module: ``enorm``, ``hnorm``, ``eh_proj``, a Llama-style block, ``shared_head.norm`` (DeepSeek-V3's names)."""

    def __init__(self, cfg: MtpConfig):
        super().__init__()
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.self_attn = Attention(hidden, hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = MLP(hidden, cfg.intermediate_size)
        self.shared_head = SharedHead(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """Outputs ``[batch, m, hidden]``; ``attend(q, k, v)`` does the attention (causal in training, cached in decoding)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos, sin)
        x = x + self.self_attn.out(attend(q, k, v))
        return x + self.mlp(self.post_attention_layernorm(x))


class MtpModules(nn.Module):
    """D MTP modules sharing the target's embedding and LM head (which are not parameters here)."""

    def __init__(self, cfg: MtpConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(MtpModule(cfg) for _ in range(cfg.num_modules))
        self.shared = {"embed": embed_weight.detach(), "lm_head": lm_head_weight.detach()}
        self.rotary = RotaryTable(cfg.head_dim, cfg.rope_theta)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.shared["embed"])

    def logits(self, d: int, hidden: torch.Tensor) -> torch.Tensor:
        """Module d's (0-based) logits over the target's vocabulary."""
        return F.linear(self.layers[d].shared_head.norm(hidden), self.shared["lm_head"])

    def run(self, d: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        cos, sin = self.rotary(positions, self.layers[d].eh_proj.weight.device)
        return self.layers[d](self.embed(tokens), hidden, cos, sin, attend)

    def step(self, d: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: PreallocatedLayer) -> torch.Tensor:
        """Module d over new rows after its cache, causally: outputs ``[1, m, hidden]``."""
        attn = self.layers[d].self_attn
        return self.run(d, tokens, hidden, positions, lambda q, k, v: cached_attention(attn, q, k, v, cache, None))

    def causal(self, d: int, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Module d over whole rows with causal attention (training): outputs ``[batch, rows, hidden]``."""
        attn = self.layers[d].self_attn
        positions = torch.arange(tokens.shape[1], device=tokens.device)

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, attn.expand_kv(k), attn.expand_kv(v), is_causal=True)

        return self.run(d, tokens, hidden, positions, attend)

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        """``config.json`` (``num_nextn_predict_layers`` and the shape) and ``model.safetensors`` (``layers.{d}.*``)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = {
            "model_type": "draftsmith_mtp",
            "num_nextn_predict_layers": self.cfg.num_modules,
            "hidden_size": self.cfg.hidden_size,
            "vocab_size": self.cfg.vocab_size,
            "draftsmith_mtp": asdict(self.cfg),
        }
        (out / CONFIG).write_text(json.dumps(config, indent=1))
        tensors = {name: t.detach().to(dtype).contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS))


def config_for_target(target: nn.Module, num_modules: int, intermediate_size: int | None = None) -> MtpConfig:
    """MTP modules as wide as ``target``, with its heads, rotary and vocabulary."""
    tc = target.config
    return MtpConfig(
        hidden_size=tc.hidden_size,
        vocab_size=output_vocab_size(target),
        num_modules=num_modules,
        attention_bias=bool(getattr(tc, "attention_bias", False)) or tc.model_type in BIASED_ATTENTION,
        **layer_shape(target, intermediate_size=intermediate_size),
    )


def modules_for_target(cfg: MtpConfig, target: nn.Module) -> MtpModules:
    """Modules of shape ``cfg`` sharing ``target``'s embedding and LM head; InputError for another hidden size or vocabulary."""
    for what, mine, theirs in (
        ("hidden size", cfg.hidden_size, target.config.hidden_size),
        ("vocabulary", cfg.vocab_size, output_vocab_size(target)),
    ):
        if mine != theirs:
            raise InputError(f"MTP modules of {what} {mine} do not fit this target's {what} {theirs}: they are another model's")
    modules = MtpModules(cfg, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return modules.to(target.device)


def load_modules(path: str | Path, target: nn.Module) -> MtpModules:
    """Load modules written by ``MtpModules.save``; a bad file or another model's modules is one InputError line."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"MTP directory {path} does not exist (no hub downloads: give a local directory)")
    try:
        cfg = MtpConfig(**json.loads((path / CONFIG).read_text(encoding="utf-8"))["draftsmith_mtp"])
    except FileNotFoundError:
        raise InputError(f"MTP directory {path} has no {CONFIG}") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InputError(f"MTP config {path / CONFIG} cannot be used: {error}") from error
    modules = modules_for_target(cfg, target)
    try:
        tensors = load_file(str(path / WEIGHTS))
    except (OSError, SafetensorError) as error:
        raise InputError(f"MTP weights {path / WEIGHTS} cannot be read (missing, truncated or corrupt): {error}") from error
    check_tensors(path / WEIGHTS, tensors, modules.state_dict(), "MTP")
    modules.load_state_dict({name: t.float() for name, t in tensors.items()})
    return modules.eval()


class MtpProposer:
    """Draft a chain with MTP modules: module d guesses the token at depth d.

    Args:
        model: a directory written by ``MtpModules.save`` (the trainer's ``type: mtp``), a model
            checkpoint that ships MTP modules (``proposers.mtp_native``: DeepSeek-V3, GLM-4.5,
            Qwen3-Next, MiMo layouts), or modules.
        k: draft depth (default: the number of modules). Above it only with ``recursive``.
        recursive: reuse the last module for the depths past the modules' number (chains).
        tree_width: 1 drafts a chain; more grows a top-``tree_width`` tree through the shared
            dynamic tree builder (``proposers.tree``), each node scored by the next module
            over its own path.
        max_nodes: a tree's node budget (None: no limit beyond width and depth).
        sample: at T > 0, a tree's children are sampled with their true draft distributions
            (False: top-k point masses).
        min_path_prob: a tree's nodes under this path probability are never expanded, and a
            greedy tree drops them (``grow_dynamic_tree``).
        target: the target (its embedding, LM head and shape).
        tokenizer: the target's tokenizer (written into an export, which the engine serves).
    """

    hidden_layers: tuple[int, ...] = (-1,)

    def __init__(
        self,
        model: MtpModules | str | Path,
        k: int | None = None,
        recursive: bool = False,
        tree_width: int = 1,
        max_nodes: int | None = None,
        sample: bool = True,
        min_path_prob: float | None = None,
        target: nn.Module | None = None,
        tokenizer=None,
    ):
        if isinstance(model, (str, Path)):
            if target is None:
                raise InputError("MTP modules share the target's embedding and LM head: load them with the target")
            from .mtp_native import is_native, load_native  # the layouts model checkpoints ship

            model = load_native(model, target) if is_native(model) else load_modules(model, target)
        self.modules = model.eval()
        self.num_modules = model.cfg.num_modules
        self.k = self.num_modules if k is None else check_integer("k", k)
        if self.k < 1:
            raise InputError(f"k must be >= 1, got {k}")
        if self.k > self.num_modules and not recursive:
            raise InputError(
                f"k={self.k} is deeper than the {self.num_modules} MTP module(s): lower k or set recursive: true to reuse the last module"
            )
        if check_integer("tree_width", tree_width) < 1:
            raise InputError(f"tree_width must be >= 1 (1: a chain), got {tree_width}")
        if tree_width > 1 and self.k > self.num_modules:
            raise InputError("recursive reuse drafts chains: a tree (tree_width > 1) is at most as deep as the modules")
        if max_nodes is not None and check_integer("max_nodes", max_nodes) < 1:
            raise InputError(f"max_nodes must be >= 1, got {max_nodes}")
        self.tree_width, self.max_nodes, self.sample = tree_width, max_nodes, sample
        self.min_path_prob = check_probability("min_path_prob", min_path_prob)
        self.recursive, self.vocab_size = recursive, model.cfg.vocab_size
        self.device = next(model.parameters()).device
        self.caches: list[PreallocatedLayer] = []
        self.target, self.tokenizer = target, tokenizer  # for export, which writes the target with the modules

    def transformers_peer(self):
        return None

    def export(self, out_dir: str | Path, format: str = "vllm") -> EngineExport:
        """The target with these modules in MiMo's layout, which vLLM serves with ``method: mtp`` (that directory is the model).

        vLLM runs MTP only inside a target whose architecture ships the modules; MiMo's is a
        Qwen2 with ``model.mtp_layers.{i}`` (``mtp_native.mimo_checkpoint``). Its MiMo path
        drafts every depth with module 1, fed its own normed output, which is not how these
        modules draft past depth 1: ``k`` above 1 warns (``k: 1`` drafts as the engine does).
        """
        check_format(format, ("vllm",), "mtp")
        if self.target is None:
            raise InputError("an MTP export writes the target with its modules: load the proposer with the target")
        if self.k > 1:
            warnings.warn(
                f"vLLM's MiMo MTP path drafts every depth with module 1; this proposer drafts {self.k} deep with its modules "
                "(k: 1 drafts as the engine does)",
                stacklevel=2,
            )
        from .mtp_native import mimo_checkpoint

        config, tensors = mimo_checkpoint(self.modules, self.target)

        def write(directory: Path) -> None:
            directory.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
            (directory / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
            if self.tokenizer is not None:  # the engine serves this directory: it needs the tokenizer beside the weights
                self.tokenizer.save_pretrained(directory)

        fields = {"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": self.num_modules}
        path = write_export(out_dir, write, tensors, fields)
        return write_spec(EngineExport(path, format, {"method": "mtp", "num_speculative_tokens": self.k}, model=path))

    def begin(self, prompt: list[int], features: TargetFeatures | None) -> None:
        self.caches = [PreallocatedLayer(len(prompt) + CACHE_HEADROOM) for _ in range(self.num_modules)]
        self.fed = [0] * self.num_modules  # committed positions each module has seen
        # module m's inputs at positions fed[m] on (the target's features for m = 0, else module m - 1's outputs)
        self.pending: list[torch.Tensor | None] = [None] * self.num_modules
        self.last: list[torch.Tensor | None] = [None] * self.num_modules  # each module's output at its last committed position
        self._add_features(features)

    def observe(self, result: VerifyResult, features: TargetFeatures | None) -> None:
        self._add_features(features)

    def _add_features(self, features: TargetFeatures | None) -> None:
        if features is None or -1 not in features.hidden_states:
            raise ValueError("the MTP proposer needs the target's final hidden state (layer -1) with every observe")
        self._append(0, features.hidden_states[-1].float().to(self.device))

    def _append(self, m: int, rows: torch.Tensor) -> None:
        self.pending[m] = rows if self.pending[m] is None else torch.cat([self.pending[m], rows])

    @torch.inference_mode()
    def propose(self, context: ProposeContext) -> Draft:
        if not self.caches:
            raise ValueError("propose() before begin(): the MTP proposer needs the prompt's features")
        tokens, n = context.tokens, len(context.tokens)
        depth = min(self.k, context.max_depth)
        if self.tree_width > 1:
            return self._tree(context, depth)
        guesses: list[int] = []
        rows: list[torch.Tensor | None] = []
        current = None
        for m in range(self._prepare(tokens, depth)):
            if m == 0:
                current = self.last[0]  # position n - 2, which reads the root: depth 1
            else:  # positions n - 1 - m .. n - 2, which read the guesses of depths 1 .. m
                inputs = torch.cat([self.pending[m][-1:], current if m > 1 else current[:0]])
                ids = torch.tensor([guesses], device=self.device)
                current = self.modules.step(m, ids, inputs[None], torch.arange(n - 1 - m, n - 1, device=self.device), self.caches[m])[0]
            guess, row = self._choose(self.modules.logits(m, current[-1:])[0], context)
            guesses.append(guess)
            rows.append(row)
        if len(guesses) == self.num_modules:
            last, hidden = self.num_modules - 1, current[-1:]
            for extra in range(len(guesses), depth):  # recursive: the last module, one position further each time
                position = torch.tensor([n - 2 + extra - last], device=self.device)
                hidden = self.modules.step(
                    last, torch.tensor([[guesses[-1]]], device=self.device), hidden[None], position, self.caches[last]
                )[0]
                guess, row = self._choose(self.modules.logits(last, hidden)[0], context)
                guesses.append(guess)
                rows.append(row)
        if not guesses:
            return Draft.empty()
        return Draft.chain(guesses, torch.stack(rows) if rows[0] is not None else None)

    def _tree(self, context: ProposeContext, depth: int) -> Draft:
        """A top-``tree_width`` tree through the shared builder; a node at depth d is scored by module d + 1 over its path."""
        n = len(context.tokens)
        ready = self._prepare(context.tokens, depth)
        if ready == 0:
            return Draft.empty()
        rows: dict[int, torch.Tensor] = {-1: self.last[0][:0]}  # node -> module d + 1's rows along its path

        def score(tree, nodes: list[int]) -> torch.Tensor:
            logits = []
            for node in nodes:
                m, path = tree.depths[node], [node]
                while tree.parents[path[-1]] >= 0:
                    path.append(tree.parents[path[-1]])
                ids = torch.tensor([[tree.tokens[i] for i in reversed(path)]], device=self.device)
                hidden = torch.cat([self.pending[m][-1:], rows[tree.parents[node]]])
                out = self.modules.step(m, ids, hidden[None], torch.arange(n - 1 - m, n - 1, device=self.device), self.caches[m])[0]
                self.caches[m].truncate(self.fed[m])
                rows[node] = out
                logits.append(self.modules.logits(m, out[-1:])[0])
            return torch.stack(logits).float().cpu()

        root = self.modules.logits(0, self.last[0])[0].float().cpu()
        sampled = self.sample and not context.sampling.greedy
        grown = grow_dynamic_tree(
            root,
            score,
            ready,
            self.tree_width,
            context.sampling,
            sampled,
            max_nodes=self.max_nodes,
            generator=context.generator,
            min_path_prob=self.min_path_prob,
        )
        return grown.draft

    def _prepare(self, tokens: list[int], depth: int) -> int:
        """Drop the last step's guessed rows and catch every module up to the root; return how many are ready to draft
        (caught up, with their first input row at hand: a short prompt leaves deeper modules out)."""
        n = len(tokens)
        for m in range(min(depth, self.num_modules)):
            self.caches[m].truncate(self.fed[m])
            self._catch_up(m, tokens)
            if self.fed[m] != n - 1 - m or (m > 0 and self.pending[m] is None) or self.last[0] is None:
                return m
        return min(depth, self.num_modules)

    def _catch_up(self, m: int, tokens: list[int]) -> None:
        """Run module m over the committed positions it has not seen: p <= n - 2 - m (it reads token p + m + 1)."""
        start, end = self.fed[m], len(tokens) - 2 - m
        if end < start or self.pending[m] is None:
            return
        count = end + 1 - start
        inputs, rest = self.pending[m][:count], self.pending[m][count:]
        ids = torch.tensor([tokens[start + m + 1 : end + m + 2]], device=self.device)
        out = self.modules.step(m, ids, inputs[None], torch.arange(start, end + 1, device=self.device), self.caches[m])[0]
        self.pending[m] = rest if rest.shape[0] else None
        self.fed[m], self.last[m] = end + 1, out[-1:]
        if m + 1 < self.num_modules:
            self._append(m + 1, out)

    @staticmethod
    def _choose(logits: torch.Tensor, context: ProposeContext) -> tuple[int, torch.Tensor | None]:
        """The greedy guess (a point mass), or a sample with the distribution it was drawn from."""
        if context.sampling.greedy:
            return int(logits.argmax()), None
        probs = logits_to_probs(logits.float().cpu(), context.sampling)
        return int(torch.multinomial(probs, 1, generator=context.generator)), probs
