"""Capture what the frozen target computes on a batch: the inputs of every head's loss.

Layer indices follow transformers' ``output_hidden_states`` everywhere in the project: 0
is the embedding output, ``i`` the output of decoder layer ``i``, and ``N`` (the number of
layers, or -1) the final state after the model's last norm, the one its LM head reads.

Online (the default), ``capture`` runs the target on each training batch in the same
process. Offline, a command writes the captured features of a recipe's data once, as
safetensors shards, and training reads them back as the same batches:

    draftsmith capture --config recipes/training/<recipe>.yaml [key=value ...]

It prints a size estimate (tokens x layers x hidden x bytes) first and refuses above
``capture.max_gb``; shards are written atomically, so an interrupted capture resumes where
it stopped. Logits are never stored: they are rebuilt from the stored final state by the
target's LM head, which a check at capture time proves equal to the target's own logits.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from draftsmith.proposers.core.errors import ConfigError
from draftsmith.proposers.core.files import atomic_file
from draftsmith.training.common import config_hash, file_signature


@dataclass
class CaptureConfig:
    """Where the target's features come from: computed per batch (online) or read from ``dir`` (offline)."""

    mode: Literal["online", "offline"] = "online"
    dir: str = ""  # offline shards ("" = run_dir/capture)
    max_gb: float = 50.0  # the offline capture refuses to write more than this
    batch_size: int = 16  # rows per target forward while capturing
    rows_per_shard: int = 1024


@dataclass(frozen=True)
class Captured:
    """The frozen target's outputs on one batch.

    Args:
        logits: ``[batch, seq, vocab]`` the target's logits, or None when the head does not need them.
        hidden: layer index (as the head asked for it) -> ``[batch, seq, hidden]``.
    """

    logits: torch.Tensor | None
    hidden: dict[int, torch.Tensor]


@torch.no_grad()
def capture(target, input_ids: torch.Tensor, layers: tuple[int, ...] = (), logits: bool = True) -> Captured:
    """Run the frozen ``target`` on ``input_ids`` ``[batch, seq]``; return its logits and the hidden states of ``layers``."""
    out = target(input_ids=input_ids, output_hidden_states=bool(layers))
    return Captured(out.logits if logits else None, {layer: out.hidden_states[layer] for layer in layers})


def final_layer(target) -> int:
    """The index of the final (normed) state in ``output_hidden_states``: the number of decoder layers."""
    return int(target.config.num_hidden_layers)


def stored_layers(target, layers: tuple[int, ...], logits: bool) -> list[int]:
    """The non-negative layer indices an offline capture stores (the final state too when logits are needed)."""
    last = final_layer(target)
    wanted = {layer % (last + 1) for layer in layers} | ({last} if logits else set())
    return sorted(wanted)


class Capturer:
    """Turns a batch into ``Captured``: by running the target (online) or from the stored features (offline).

    Args:
        target: the frozen target.
        layers: hidden layers the head needs.
        logits: whether the head needs the target's logits.
        offline: whether batches carry stored features (``hidden.<layer>`` tensors).
    """

    def __init__(self, target, layers: tuple[int, ...], logits: bool, offline: bool):
        self.target, self.layers, self.logits, self.offline = target, tuple(layers), logits, offline
        self.last = final_layer(target)

    def __call__(self, batch: dict[str, torch.Tensor]) -> Captured:
        """What the head's loss reads, on the batch's device (where accelerate trains the head): a target split over
        devices (``target_device_map``) hands each layer over from its own, and stored features come from the host."""
        device = batch["input_ids"].device
        if not self.offline:
            captured = capture(self.target, batch["input_ids"], self.layers, self.logits)
        else:
            hidden = {layer: batch[f"hidden.{layer % (self.last + 1)}"] for layer in self.layers}
            logits = None
            if self.logits:
                head = self.target.get_output_embeddings()
                with torch.no_grad():
                    logits = head(batch[f"hidden.{self.last}"].to(head.weight.device))
            captured = Captured(logits, hidden)
        logits = captured.logits.to(device) if captured.logits is not None else None
        return Captured(logits, {layer: h.to(device) for layer, h in captured.hidden.items()})


# --- offline shards ------------------------------------------------------------------

MANIFEST = "capture.json"


def capture_key(target_path: str, target_dtype: str, data: dict, layers: list[int]) -> str:
    """Hash of everything the stored features depend on: the target's weights and dtype, the data keys, the layers."""
    return config_hash({"target": file_signature(target_path), "dtype": target_dtype, "data": data, "layers": layers})


def estimate_bytes(tokens: int, layers: int, hidden_size: int, element_bytes: int) -> int:
    """Bytes of stored features: tokens x layers x hidden x bytes (token ids and masks are small next to them)."""
    return tokens * layers * hidden_size * element_bytes


def capture_dataset(target, splits: dict, capture_dir: Path, layers: list[int], key: str, settings) -> dict:
    """Capture every split's rows into ``capture_dir/<split>/``; print the size estimate first, refuse above ``settings.max_gb``.

    Args:
        splits: split name -> rows (``{"input_ids", "loss_mask"}`` lists, e.g. a ``datasets.Dataset``).
        layers: the non-negative layers to store (``stored_layers``).
        key: ``capture_key`` of what the rows and features depend on; a directory holding
            another key is refused, one holding this key resumes.
        settings: ``max_gb``, ``batch_size`` and ``rows_per_shard`` (the recipe's ``capture:`` section).
    """
    tokens = sum(len(ids) for rows in splits.values() for ids in rows["input_ids"])
    element, hidden = torch.finfo(target.dtype).bits // 8, target.config.hidden_size
    size = estimate_bytes(tokens, len(layers), hidden, element)
    estimate = f"{tokens:,} tokens x {len(layers)} layers {layers} x {hidden} hidden x {element} bytes"
    print(f"offline capture: {estimate} = {size:,} bytes ({size / 1e9:.3g} GB)")
    if size > settings.max_gb * 1e9:
        raise ConfigError(
            f"the offline capture needs {size / 1e9:.3f} GB, over capture.max_gb={settings.max_gb}; raise it or capture online"
        )
    if final_layer(target) in layers:
        check_logits_from_head(target, list(splits["train"][0]["input_ids"]))
    manifest_path = Path(capture_dir) / MANIFEST
    old = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if old.get("key") not in (None, key):
        raise ConfigError(
            f"capture.dir {capture_dir} holds a capture of another target, data or layers; give another capture.dir or delete it"
        )
    manifest = {"key": key, "layers": layers, "tokens": tokens, "bytes": size, "complete": False, "splits": {}}
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=1))
    for name, rows in splits.items():
        shards = write_shards(
            target, rows, Path(capture_dir) / name, layers, settings.batch_size, settings.rows_per_shard, f"capture {name}"
        )
        manifest["splits"][name] = {"rows": len(rows), "shards": shards}
    manifest["complete"] = True
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest


@torch.no_grad()
def check_logits_from_head(target, input_ids: list[int]) -> None:
    """Refuse to rebuild logits offline when the LM head on the final state does not give the target's own logits."""
    out = target(input_ids=torch.tensor([input_ids], device=target.device), output_hidden_states=True)
    if not torch.equal(target.get_output_embeddings()(out.hidden_states[-1]), out.logits):
        raise ConfigError("this target's logits are not its LM head on the final hidden state (soft-capping?); capture online instead")


@torch.no_grad()
def write_shards(target, rows, out_dir: Path, layers: list[int], batch_size: int, rows_per_shard: int, desc: str = "capture") -> int:
    """Capture ``rows`` (``{"input_ids", "loss_mask"}`` lists) in order into ``out_dir/shard_<n>.safetensors``; return the shard count.

    A shard holds its rows' tokens end to end: ``input_ids`` ``[tokens]``, ``loss_mask``
    ``[tokens]``, ``offsets`` ``[rows + 1]`` and ``hidden.<layer>`` ``[tokens, hidden]``. Rows
    are batched only with rows of their own length, unpadded, so packed text gets the
    features an online batch computes, bit for bit; existing shards are kept (resume).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    count = (len(rows) + rows_per_shard - 1) // rows_per_shard
    for shard in tqdm(range(count), desc=desc, unit="shard"):
        path = out_dir / f"shard_{shard:05d}.safetensors"
        if path.is_file():
            continue
        part = rows[shard * rows_per_shard : (shard + 1) * rows_per_shard]
        ids = [list(r) for r in part["input_ids"]]
        features: dict[int, list[torch.Tensor | None]] = {layer: [None] * len(ids) for layer in layers}
        for batch in _same_length_batches(ids, batch_size):
            input_ids = torch.tensor([ids[i] for i in batch], device=target.device)
            out = target(input_ids=input_ids, output_hidden_states=True)
            for layer in layers:
                for row, i in enumerate(batch):
                    features[layer][i] = out.hidden_states[layer][row].cpu()
        tensors = {
            "input_ids": torch.tensor([t for row in ids for t in row], dtype=torch.long),
            "loss_mask": torch.tensor([m for row in part["loss_mask"] for m in row], dtype=torch.bool),
            "offsets": torch.tensor([0, *torch.tensor([len(r) for r in ids]).cumsum(0).tolist()], dtype=torch.long),
        }
        tensors.update({f"hidden.{layer}": torch.cat(features[layer]).contiguous() for layer in layers})
        with atomic_file(path) as partial:
            save_file(tensors, str(partial))
    return count


def _same_length_batches(rows: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices of ``rows`` grouped by length, at most ``batch_size`` per group."""
    by_length: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_length.setdefault(len(row), []).append(i)
    return [group[j : j + batch_size] for group in by_length.values() for j in range(0, len(group), batch_size)]


class CapturedRows(Dataset):
    """Rows of an offline capture, in the order they were written: ``{"input_ids", "loss_mask", "hidden.<layer>"}``."""

    def __init__(self, split_dir: Path):
        self.paths = sorted(Path(split_dir).glob("shard_*.safetensors"))
        if not self.paths:
            raise FileNotFoundError(f"no captured shards in {split_dir}")
        self.offsets = []  # per shard: [rows + 1]
        for path in self.paths:
            with safe_open(str(path), framework="pt") as f:
                self.offsets.append(f.get_tensor("offsets").tolist())
        self.starts = [0]
        for offsets in self.offsets:
            self.starts.append(self.starts[-1] + len(offsets) - 1)
        self._open: dict[int, object] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = next(s for s in range(len(self.paths)) if index < self.starts[s + 1])
        row = index - self.starts[shard]
        begin, end = self.offsets[shard][row], self.offsets[shard][row + 1]
        if shard not in self._open:
            self._open[shard] = safe_open(str(self.paths[shard]), framework="pt")
        f = self._open[shard]
        item = {name: f.get_slice(name)[begin:end] for name in f.keys() if name != "offsets"}
        item["input_ids"], item["loss_mask"] = item["input_ids"].tolist(), item["loss_mask"].tolist()
        return item

    def __getstate__(self):  # open file handles stay in the process that opened them (DataLoader workers)
        return {**self.__dict__, "_open": {}}


def read_manifest(capture_dir: Path, key: str) -> dict:
    """The manifest of a complete offline capture made for ``key``; a clear error otherwise."""
    path = Path(capture_dir) / MANIFEST
    hint = "run `draftsmith capture --config <this recipe>` first"
    if not path.is_file():
        raise FileNotFoundError(f"capture.dir {capture_dir} holds no offline capture ({MANIFEST}); {hint}")
    manifest = json.loads(path.read_text())
    if manifest.get("key") != key:
        raise ConfigError(
            f"capture.dir {capture_dir} was captured for another target, data or layers; {hint} (or give another capture.dir)"
        )
    if not manifest.get("complete"):
        raise ConfigError(f"the capture in {capture_dir} is incomplete; {hint} to finish it")
    return manifest


def offline_key(cfg, target, objective) -> str:
    """What an offline capture of a training recipe depends on (target weights and dtype, data keys, stored layers).

    Args:
        cfg: the recipe (``training.recipe.TrainConfig``); objective: its family's ``Objective``.
    """
    objective.check(target, None)  # resolves target-dependent layers (EAGLE-3's default aux layers)
    # chat_format says nothing about text data: leaving it out keeps the captures made before it existed
    skip = ("self_distill", "chat_format") if cfg.data.format == "text" else ("self_distill",)
    data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in skip}
    data["self_distill"] = {k: v for k, v in dataclasses.asdict(cfg.data.self_distill).items() if k not in ("cache_dir", "batch_size")}
    data["seed"] = cfg.seed
    layers = stored_layers(target, objective.hidden_layers, objective.needs_logits)
    return capture_key(cfg.target, cfg.target_dtype, data, layers)
