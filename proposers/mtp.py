"""MTP: multi-token-prediction modules (DeepSeek-V3 style) as the draft.

Module d (1 .. D) reads the hidden state from depth d - 1 (the target's final hidden
state for d = 1) and the embedding of the token at depth d, and predicts the token at
depth d + 1 (the modules and their checkpoints: ``proposers.mtp_head``).

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
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .core.cache import CACHE_HEADROOM, PreallocatedLayer
from .core.checkpoint import CONFIG, WEIGHTS
from .core.devices import check_shared_device, host_lists, reads_are_free
from .core.dynamic_tree import grow_dynamic_tree
from .core.engine import EngineExport, check_format, write_export, write_spec
from .core.errors import InputError, check_integer, check_probability
from .core.proposer import ProposerBase
from .core.sampling import logits_to_probs
from .core.types import Draft, ProposeContext, TargetFeatures, VerifyResult
from .mtp_head import MtpModules, load_modules
from .mtp_native import is_native, load_native, mimo_checkpoint


class MtpProposer(ProposerBase):
    """Draft a chain with MTP modules: module d guesses the token at depth d.

    Args:
        model: a directory written by ``MtpModules.save`` (the trainer's ``type: mtp``), a model
            checkpoint that ships MTP modules (``proposers.mtp_native``: DeepSeek-V3, GLM-4.5,
            Qwen3-Next, MiMo layouts), or modules.
        k: draft depth (default: the number of modules). Above it only with ``recursive``.
        recursive: reuse the last module for the depths past the modules' number (chains).
        tree_width: 1 drafts a chain; more grows a top-``tree_width`` tree through the shared
            dynamic tree builder (``proposers.core.tree``), each node scored by the next module
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
        check_shared_device("MTP modules", self.device, model.shared)
        self.caches: list[PreallocatedLayer] = []
        self.target, self.tokenizer = target, tokenizer  # for export, which writes the target with the modules

    def draft_depth(self) -> int:
        return self.k

    def draft_width(self) -> int:
        return self.tree_width

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
        self.pending: list[list[torch.Tensor]] = [[] for _ in range(self.num_modules)]  # chunks, joined when read
        self.last: list[torch.Tensor | None] = [None] * self.num_modules  # each module's output at its last committed position
        self._add_features(features)

    def observe(self, result: VerifyResult, features: TargetFeatures | None) -> None:
        self._add_features(features)

    def _add_features(self, features: TargetFeatures | None) -> None:
        if features is None or -1 not in features.hidden_states:
            raise ValueError("the MTP proposer needs the target's final hidden state (layer -1) with every observe")
        self._append(0, features.hidden_states[-1].float().to(self.device))

    def _append(self, m: int, rows: torch.Tensor) -> None:
        self.pending[m].append(rows)  # joined once when read: steps without a draft only append

    def _inputs(self, m: int) -> torch.Tensor | None:
        """Module m's pending inputs as one tensor (None: none)."""
        chunks = self.pending[m]
        if len(chunks) > 1:
            chunks[:] = [torch.cat(chunks)]
        return chunks[0] if chunks else None

    @torch.inference_mode()
    def propose(self, context: ProposeContext) -> Draft:
        if not self.caches:
            raise ValueError("propose() before begin(): the MTP proposer needs the prompt's features")
        tokens, n = context.tokens, len(context.tokens)
        depth, width = min(self.k, context.max_depth), min(self.tree_width, context.max_width or self.tree_width)
        if width > 1:
            return self._tree(context, depth)
        # each depth's guess and its draft probability stay on the modules' device ([1] each): the host reads them once
        guesses: list[torch.Tensor] = []
        rows: list[torch.Tensor | None] = []
        scores: list[torch.Tensor] = []
        current = None
        for m in range(self._prepare(tokens, depth)):
            if m == 0:
                current = self.last[0]  # position n - 2, which reads the root: depth 1
            else:  # positions n - 1 - m .. n - 2, which read the guesses of depths 1 .. m
                inputs = torch.cat([self._inputs(m)[-1:], current if m > 1 else current[:0]])
                current = self.modules.step(m, torch.cat(guesses)[None], inputs[None], range(n - 1 - m, n - 1), self.caches[m])[0]
            guess, row, score = self._choose(self.modules.logits(m, current[-1:])[0], context)
            guesses.append(guess)
            rows.append(row)
            scores.append(score)
        if len(guesses) == self.num_modules:
            last, hidden = self.num_modules - 1, current[-1:]
            for extra in range(len(guesses), depth):  # recursive: the last module, one position further each time
                hidden = self.modules.step(last, guesses[-1][None], hidden[None], [n - 2 + extra - last], self.caches[last])[0]
                guess, row, score = self._choose(self.modules.logits(last, hidden)[0], context)
                guesses.append(guess)
                rows.append(row)
                scores.append(score)
        if not guesses:
            return Draft.empty()
        tokens, scores = host_lists(torch.cat(guesses), torch.cat(scores))  # one read
        return Draft.chain(tokens, torch.stack(rows) if rows[0] is not None else None, scores=scores)

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
                hidden = torch.cat([self._inputs(m)[-1:], rows[tree.parents[node]]])
                out = self.modules.step(m, ids, hidden[None], range(n - 1 - m, n - 1), self.caches[m])[0]
                self.caches[m].truncate(self.fed[m])
                rows[node] = out
                logits.append(self.modules.logits(m, out[-1:])[0])
            return torch.stack(logits).float()

        root = self.modules.logits(0, self.last[0])[0].float()
        sampled = self.sample and not context.sampling.greedy
        grown = grow_dynamic_tree(
            root,
            score,
            ready,
            self.tree_width,
            context.sampling,
            sampled,
            max_nodes=self.max_nodes,
            generator=context.generator_for(self.device),
            min_path_prob=self.min_path_prob,
            stop=context.stop,
        )
        return grown.draft

    def _prepare(self, tokens: list[int], depth: int) -> int:
        """Drop the last step's guessed rows and catch every module up to the root; return how many are ready to draft
        (caught up, with their first input row at hand: a short prompt leaves deeper modules out)."""
        n = len(tokens)
        for m in range(min(depth, self.num_modules)):
            self.caches[m].truncate(self.fed[m])
            self._catch_up(m, tokens)
            if self.fed[m] != n - 1 - m or (m > 0 and not self.pending[m]) or self.last[0] is None:
                return m
        return min(depth, self.num_modules)

    def _catch_up(self, m: int, tokens: list[int]) -> None:
        """Run module m over the committed positions it has not seen: p <= n - 2 - m (it reads token p + m + 1)."""
        start, end = self.fed[m], len(tokens) - 2 - m
        pending = self._inputs(m)
        if end < start or pending is None:
            return
        count = end + 1 - start
        inputs, rest = pending[:count], pending[count:]
        ids = torch.tensor([tokens[start + m + 1 : end + m + 2]], device=self.device)
        out = self.modules.step(m, ids, inputs[None], range(start, end + 1), self.caches[m])[0]
        self.pending[m] = [rest] if rest.shape[0] else []
        self.fed[m], self.last[m] = end + 1, out[-1:]
        if m + 1 < self.num_modules:
            self._append(m + 1, out)

    @staticmethod
    def _choose(logits: torch.Tensor, context: ProposeContext) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The greedy guess (a point mass), or a sample with the distribution it was drawn from; and its draft probability
        (``[1]`` tensors, on the logits' device)."""
        if context.sampling.greedy:
            top = logits.float().softmax(-1).max(-1, keepdim=True)
            return top.indices, None, top.values
        probs = logits_to_probs(logits.float(), context.sampling, check=reads_are_free(logits.device))
        guess = torch.multinomial(probs, 1, generator=context.generator_for(probs.device))  # [1]
        return guess, probs, probs[guess]
