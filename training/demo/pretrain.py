"""Pretrain the offline demo target: a small Llama trained on text found on this machine.

    accelerate launch -m draftsmith.training.demo.pretrain --config recipes/training/demo_target.yaml [key=value ...]
    python -m draftsmith.training.demo.pretrain --config recipes/training/demo_target_quick.yaml

Stages, each cached under ``work_dir`` in a directory named after a hash of the
config keys it depends on, and skipped when its finished artefact is present:

1. corpus     ``corpus-<h>/manifest.json``      (training.demo.corpus: code + prose, train / held-out)
2. tokenizer  ``tokenizer-<h>/``                (training.demo.tokenizer: byte-level BPE + chat template)
3. tokens     ``tokens-<h>/meta.json``          (uint16 streams of ``<|bos|> doc <|eos|>``)
4. model      ``output_dir/heldout_loss.json``  (``training.train.fit`` with checkpoints in ``run-<h>/``)

Stage 4 is the head trainer's own loop (``training.train.fit``) on shuffled blocks of the
token streams, with next-token cross-entropy as the loss. An interrupted run (Ctrl-C,
SIGTERM, a crash) resumes from its last checkpoint in ``run-<h>/checkpoints`` when started
again with the same config; the export is atomic.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import yaml
from accelerate import PartialState
from accelerate.utils import set_seed
from torch.utils.data import Dataset
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

from draftsmith.proposers.core.config import build, load
from draftsmith.proposers.core.errors import ConfigError, InputError
from draftsmith.proposers.core.files import atomic_directory, atomic_file, check_writable
from draftsmith.proposers.core.models import torch_threads
from draftsmith.training.common import (
    check_output_dir,
    config_hash,
    make_adamw,
    multi_process_cpu,
    plot_curve,
    recipe_command,
    small_llama,
)
from draftsmith.training.data import make_loader
from draftsmith.training.demo.corpus import DOMAINS, SPLITS, Document, collect_corpus
from draftsmith.training.demo.tokenizer import build_tokenizer
from draftsmith.training.loop import fit, make_accelerator
from draftsmith.training.recipe import LoopConfig


@dataclass
class PretrainConfig(LoopConfig):
    """Every key a recipe may set (the loop's keys included); an unknown key is an error."""

    output_dir: str = "outputs/demo_target"  # the model, tokenizer, curves (the shipped one: recipes/models/demo_target)
    work_dir: str = ".cache/draftsmith/demo_target"  # stage caches and checkpoints
    init_from: str | None = None  # continue from this save_pretrained model (and its tokenizer) instead of a fresh one
    # corpus (training.demo.corpus)
    code_max_mb: float = 12.0  # cap on kept code text, MB of UTF-8
    prose_max_mb: float = 12.0  # cap on kept prose text
    heldout_mod: int = 20  # a file is held out when sha1(path) % heldout_mod == 0
    # tokenizer
    vocab_size: int = 2048
    # model (LlamaConfig)
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 4
    block_size: int = 256  # training context, also max_position_embeddings
    eval_tokens: int = 32768  # held-out tokens per domain for the evaluations during training
    # the loop's keys, with this recipe's defaults
    batch_size: int = 16
    learning_rate: float = 3e-3
    warmup_steps: int = 200
    weight_decay: float = 0.1
    max_steps: int = 6000
    log_every: int = 25
    eval_every: int = 250
    checkpoint_every: int = 250
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "no"
    overwrite: bool = False  # replace an output_dir that holds another recipe's output


# Keys left out of every stage's hash: where files go, how often to log, evaluate and
# save, threads, and the wall-clock budget (so a run can resume with more time).
RUNTIME_KEYS = set(
    "output_dir overwrite work_dir max_minutes log_every eval_every eval_tokens checkpoint_every keep_checkpoints threads save_dtype "
    "log_with project".split()
)
CORPUS_KEYS = ("code_max_mb", "prose_max_mb", "heldout_mod")
TOKENIZER_KEYS = (*CORPUS_KEYS, "vocab_size", "block_size")
CONFIG_FILE = "training_config.yaml"


# --- config --------------------------------------------------------------


def config_from_dict(values: dict) -> PretrainConfig:
    """A ``PretrainConfig`` from plain values; unknown keys and wrong types fail."""
    return build(PretrainConfig, values, where="pretrain config")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> PretrainConfig:
    """Read a YAML recipe and apply ``key=value`` overrides (values parsed as YAML); unknown keys fail."""
    return load(PretrainConfig, path, overrides, what="recipe")


def stage_hash(cfg: PretrainConfig, keys: tuple[str, ...] | None = None) -> str:
    """Short hash of the config keys a stage depends on (all non-runtime keys when None)."""
    return config_hash(dataclasses.asdict(cfg), keys, exclude=RUNTIME_KEYS)


# --- stages 1-3: corpus, tokenizer, tokens ----------------------------------


def build_corpus(cfg: PretrainConfig, work: Path) -> Path:
    """Stage 1: collect the corpus as JSON lines per domain and split; ``work/corpus`` names it stably.

    Recipes that train on the demo corpus name ``<work_dir>/corpus/<domain>.<split>.jsonl``, a
    link to the hashed directory of the last corpus built or used here, never the hash itself.
    """
    out = work / f"corpus-{stage_hash(cfg, CORPUS_KEYS)}"
    if not (out / "manifest.json").exists():
        write_corpus(cfg, out)
    link = work / "corpus"
    if not link.is_symlink() or link.readlink() != Path(out.name):
        with atomic_file(link) as partial:  # readers see the old link or the new one
            partial.symlink_to(out.name)
    return out


def write_corpus(cfg: PretrainConfig, out: Path) -> None:
    """Collect the documents and write ``<domain>.<split>.jsonl`` files and their manifest into ``out``."""
    max_bytes = {"code": int(cfg.code_max_mb * 1e6), "prose": int(cfg.prose_max_mb * 1e6)}
    corpus = collect_corpus(max_bytes=max_bytes, heldout_mod=cfg.heldout_mod)
    empty = [f"{d}.{s}" for d, splits in corpus.items() for s, docs in splits.items() if not docs]
    if empty:
        raise InputError(f"no documents in {empty}: raise code_max_mb / prose_max_mb or lower heldout_mod")
    out.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for domain, splits in corpus.items():
        for split, docs in splits.items():
            with open(out / f"{domain}.{split}.jsonl", "w") as f:
                f.writelines(json.dumps(dataclasses.asdict(doc)) + "\n" for doc in docs)
            manifest[f"{domain}.{split}"] = {"files": len(docs), "chars": sum(len(d.text) for d in docs)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


def read_documents(corpus_dir: Path, domain: str, split: str) -> list[Document]:
    """The documents of one domain and split from a stage-1 directory."""
    with open(corpus_dir / f"{domain}.{split}.jsonl") as f:
        return [Document(**json.loads(line)) for line in f]


def build_tokenizer_stage(cfg: PretrainConfig, corpus_dir: Path, work: Path) -> Path:
    """Stage 2: train the tokenizer on the train split of every domain (a continued model keeps its own)."""
    if cfg.init_from is not None:
        return Path(cfg.init_from)
    out = work / f"tokenizer-{stage_hash(cfg, TOKENIZER_KEYS)}"
    if not out.exists():
        texts = [doc.text for domain in DOMAINS for doc in read_documents(corpus_dir, domain, "train")]
        with atomic_directory(out) as partial:  # renamed when complete
            build_tokenizer(texts, cfg.vocab_size, cfg.block_size, partial)
    return out


def build_tokens(cfg: PretrainConfig, corpus_dir: Path, tokenizer_dir: Path, work: Path) -> Path:
    """Stage 3: one uint16 stream of ``<|bos|> doc <|eos|>`` per domain and split."""
    out = work / f"tokens-{stage_hash(cfg, TOKENIZER_KEYS + (('init_from',) if cfg.init_from else ()))}"
    if (out / "meta.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tokenizer) < 2**16, "token streams are stored as uint16"
    out.mkdir(parents=True, exist_ok=True)
    meta = {}
    for domain, split in tqdm([(d, s) for d in DOMAINS for s in SPLITS], desc="tokenize", unit="part", leave=False):
        texts = [doc.text for doc in read_documents(corpus_dir, domain, split)]
        ids = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        stream = np.fromiter((t for doc in ids for t in (bos, *doc, eos)), dtype=np.uint16)
        np.save(out / f"{domain}.{split}.npy", stream)
        meta[f"{domain}.{split}"] = {"tokens": len(stream), "chars": sum(map(len, texts))}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return out


def load_streams(tokens_dir: Path, split: str) -> dict[str, torch.Tensor]:
    """Token streams of one split, ``{domain: LongTensor [num_tokens]}``."""
    return {d: torch.from_numpy(np.load(tokens_dir / f"{d}.{split}.npy").astype(np.int64)) for d in DOMAINS}


# --- stage 4: the model ----------------------------------------------------


def build_model(cfg: PretrainConfig, tokenizer) -> LlamaForCausalLM:
    """A freshly initialised Llama with tied input / output embeddings, or the ``init_from`` model with ``block_size`` positions."""
    if cfg.init_from is None:
        return small_llama(
            tokenizer,
            len(tokenizer),
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_layers,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.block_size,
        )
    model = AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
    shape = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers}
    shape |= {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "vocab_size": cfg.vocab_size}
    differ = {k: (v, getattr(model.config, k)) for k, v in shape.items() if getattr(model.config, k) != v}
    if differ:
        raise ConfigError(f"init_from {cfg.init_from} has another shape than the recipe (recipe, model): {differ}")
    model.config.max_position_embeddings = cfg.block_size  # rotary positions: nothing to resize
    return model


class Blocks(Dataset):
    """Consecutive ``block_size`` windows of a token stream, as training rows (every position counts)."""

    def __init__(self, stream: torch.Tensor, block_size: int):
        self.blocks = stream[: len(stream) // block_size * block_size].view(-1, block_size)
        self.loss_mask = [1] * block_size

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.blocks[index].tolist(), "loss_mask": self.loss_mask}


def next_token_loss(model, batch: dict) -> tuple[torch.Tensor, dict]:
    """Cross-entropy of every next token of ``batch["input_ids"]`` ``[batch, block]``; no extra metrics."""
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss, {}


def position_buckets(block_size: int) -> list[tuple[int, int]]:
    """Position ranges [0, 256), [256, 512), [512, 1024), ... up to ``block_size``."""
    edges = [0, 256]
    while edges[-1] < block_size:
        edges.append(edges[-1] * 2)
    edges[-1] = min(edges[-1], block_size)
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if a < block_size]


@torch.inference_mode()
def heldout_loss(model, streams: dict[str, torch.Tensor], block_size: int, max_tokens: int = 0) -> dict:
    """Mean next-token loss in nats per domain over consecutive windows of each stream, overall and by position.

    Args:
        model: a causal LM.
        streams: ``{domain: LongTensor [num_tokens]}``.
        block_size: window length; the first token of a window is context only.
        max_tokens: use the first ``max_tokens`` tokens of each stream (0 = all).
    Returns:
        ``{domain: {"nats_per_token", "tokens", "by_position": {"0-256": nats, ...}}}``; the
        loss at position p is that of predicting the window's token p + 1.
    """
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    losses = {}
    for domain, stream in streams.items():
        stream = stream[:max_tokens] if max_tokens else stream
        windows = stream[: len(stream) // block_size * block_size].view(-1, block_size)
        per_position = torch.zeros(block_size - 1, dtype=torch.float64)
        for batch in windows.split(16):
            logits = model(input_ids=batch.to(device)).logits[:, :-1].float()
            targets = batch[:, 1:].to(device)
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # [batch, block - 1]
            per_position += nll.sum(0).double().cpu()
        count = max(len(windows), 1)
        ranges = [(a, min(b, block_size - 1)) for a, b in position_buckets(block_size)]
        buckets = {f"{a}-{b}": float(per_position[a:b].sum()) / ((b - a) * count) for a, b in ranges if b > a}
        losses[domain] = {
            "nats_per_token": float(per_position.sum()) / (count * (block_size - 1)),
            "tokens": len(windows) * (block_size - 1),
            "by_position": buckets,
        }
    model.train(was_training)
    return losses


def train(cfg: PretrainConfig, tokens_dir: Path, tokenizer, run_dir: Path, interrupt_after_steps: int = 0):
    """Stage 4: ``fit`` on shuffled blocks of the training streams; returns the trained model and its loss curve."""
    accelerator = make_accelerator(cfg, run_dir)
    set_seed(cfg.seed)
    model = build_model(cfg, tokenizer)
    loader = make_loader(Blocks(torch.cat(list(load_streams(tokens_dir, "train").values())), cfg.block_size), cfg.batch_size, 0)
    model, optimizer, loader = accelerator.prepare(model, make_adamw(model, cfg.learning_rate, cfg.weight_decay), loader)
    heldout = load_streams(tokens_dir, "heldout")

    def evaluate(model) -> dict:
        losses = heldout_loss(model, heldout, cfg.block_size, cfg.eval_tokens)
        return {"heldout_loss": {domain: round(v["nats_per_token"], 4) for domain, v in losses.items()}}

    state = fit(model, optimizer, loader, next_token_loss, cfg, accelerator, run_dir, evaluate, None, "pretrain", interrupt_after_steps)
    return accelerator.unwrap_model(model), state.curve


# --- export ------------------------------------------------------------------


def export(cfg: PretrainConfig, model, tokenizer, curve: list[dict], tokens_dir: Path) -> Path:
    """Write the shipped directory atomically; held-out loss is measured on the saved weights, loaded in fp32."""
    with atomic_directory(cfg.output_dir) as out:
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        model.to(getattr(torch, cfg.save_dtype)).save_pretrained(out)
        tokenizer.model_max_length = cfg.block_size
        tokenizer.save_pretrained(out)
        (out / CONFIG_FILE).write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
        (out / "loss_curve.json").write_text(json.dumps(curve))
        plot_curve(curve, out / "loss_curve.png", title="demo target pretraining")
        shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        losses = heldout_loss(shipped, load_streams(tokens_dir, "heldout"), cfg.block_size)
        (out / "heldout_loss.json").write_text(json.dumps(losses, indent=1) + "\n")
    return Path(cfg.output_dir)


def is_exported(cfg: PretrainConfig) -> bool:
    """Whether ``output_dir`` already holds a finished model of this config."""
    out = Path(cfg.output_dir)
    if not (out / "heldout_loss.json").exists() or not (out / "training_config.yaml").exists():
        return False
    try:
        shipped = config_from_dict(yaml.safe_load((out / "training_config.yaml").read_text()))
    except ValueError:  # written by another version of this file
        return False
    return stage_hash(shipped) == stage_hash(cfg)


def run(cfg: PretrainConfig, interrupt_after_steps: int = 0) -> Path:
    """Run (or skip) every stage; returns ``output_dir``.

    Args:
        cfg: the resolved config.
        interrupt_after_steps: simulate a Ctrl-C after this training step (tests): checkpoint, raise KeyboardInterrupt.
    """
    if is_exported(cfg):
        print(f"{cfg.output_dir} already holds this config's model; nothing to do")
        return Path(cfg.output_dir)
    check_writable(cfg.work_dir, "work_dir")
    check_writable(Path(cfg.output_dir).resolve().parent, "the directory of output_dir")
    check_output_dir(cfg.output_dir, dataclasses.asdict(cfg), RUNTIME_KEYS, cfg.overwrite)
    with torch_threads(cfg.threads):
        work = Path(cfg.work_dir)
        processes = PartialState(cpu=multi_process_cpu())
        with processes.main_process_first():  # the first process builds the cached stages, the others read them
            corpus_dir = build_corpus(cfg, work)
            tokenizer_dir = build_tokenizer_stage(cfg, corpus_dir, work)
            tokens_dir = build_tokens(cfg, corpus_dir, tokenizer_dir, work)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        model, curve = train(cfg, tokens_dir, tokenizer, work / f"run-{stage_hash(cfg)}", interrupt_after_steps)
        if processes.is_main_process:
            export(cfg, model, tokenizer, curve, tokens_dir)
        processes.wait_for_everyone()
        return Path(cfg.output_dir)


def main(argv: list[str] | None = None) -> None:
    recipe_command(argv, __doc__.splitlines()[0], load_config, run, lambda out: (out / "heldout_loss.json").read_text().strip())


if __name__ == "__main__":
    main()
