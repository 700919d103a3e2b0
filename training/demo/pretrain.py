"""Pretrain the offline demo target: a small Llama trained on text found on this machine.

    accelerate launch -m training.demo.pretrain --config recipes/demo_target.yaml [key=value ...]
    python -m training.demo.pretrain --config recipes/demo_target_quick.yaml

Stages, each cached under ``work_dir`` in a directory named after a hash of the
config keys it depends on, and skipped when its finished artefact is present:

1. corpus     ``corpus-<h>/manifest.json``      (training.demo.corpus: code + prose, train / held-out)
2. tokenizer  ``tokenizer-<h>/``                (training.demo.tokenizer: byte-level BPE + chat template)
3. tokens     ``tokens-<h>/meta.json``          (uint16 streams of ``<|bos|> doc <|eos|>``)
4. model      ``output_dir/heldout_loss.json``  (training loop with checkpoints in ``run-<h>/``)

The loop reads like nanoGPT's ``train.py``: sample a batch, step, log, evaluate,
checkpoint. An interrupted run (Ctrl-C, SIGTERM, a crash) resumes from its last
checkpoint in ``run-<h>/checkpoints`` when started again with the same config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from accelerate import Accelerator, PartialState
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from draftsmith.training.common import (
    TrainState,
    all_agree,
    config_hash,
    cosine_lr,
    first_process,
    load_recipe,
    make_adamw,
    multi_process_cpu,
    plot_curve,
    resume,
    save_checkpoint,
    sigterm_as_interrupt,
)
from draftsmith.training.common import config_from_dict as _config_from_dict
from draftsmith.training.demo.corpus import DOMAINS, SPLITS, Document, collect_corpus
from draftsmith.training.demo.tokenizer import build_tokenizer


@dataclass
class PretrainConfig:
    """Every key a recipe may set; an unknown key is an error."""

    output_dir: str = "recipes/demo_target"  # the shipped model, tokenizer, curves
    work_dir: str = ".cache/draftsmith/demo_target"  # stage caches and checkpoints
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
    # optimisation
    batch_size: int = 16  # sequences per step
    learning_rate: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int = 6000
    max_minutes: float = 0.0  # wall-clock budget of the loop (0 = none); the schedule decays by it too
    seed: int = 0
    # logging, evaluation, checkpoints
    log_every: int = 25
    eval_every: int = 250
    eval_tokens: int = 32768  # held-out tokens per domain for the evaluations during training
    checkpoint_every: int = 250
    keep_checkpoints: int = 2
    # runtime
    threads: int = 0  # torch CPU threads (0 = torch default)
    mixed_precision: str = "no"  # accelerate: no | bf16 | fp16
    save_dtype: str = "float32"  # dtype of the shipped safetensors: float32 | float16 | bfloat16


# Keys left out of every stage's hash: where files go, how often to log, evaluate and
# save, threads, and the wall-clock budget (so a run can resume with more time).
CHOICES = {"mixed_precision": ("no", "bf16", "fp16"), "save_dtype": ("float32", "float16", "bfloat16")}
RUNTIME_KEYS = set(
    "output_dir work_dir max_minutes log_every eval_every eval_tokens checkpoint_every keep_checkpoints threads save_dtype".split()
)
CORPUS_KEYS = ("code_max_mb", "prose_max_mb", "heldout_mod")
TOKENIZER_KEYS = (*CORPUS_KEYS, "vocab_size", "block_size")


# --- config --------------------------------------------------------------


def config_from_dict(values: dict) -> PretrainConfig:
    """A ``PretrainConfig`` from plain values; unknown keys and wrong types fail."""
    return _config_from_dict(PretrainConfig, values, CHOICES)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> PretrainConfig:
    """Read a YAML recipe and apply ``key=value`` overrides (values parsed as YAML); unknown keys fail.

    Args:
        path: YAML file of ``PretrainConfig`` keys (None = the defaults).
        overrides: ``["key=value", ...]`` applied after the file.
    """
    return load_recipe(PretrainConfig, path, overrides, CHOICES)


def stage_hash(cfg: PretrainConfig, keys: tuple[str, ...] | None = None) -> str:
    """Short hash of the config keys a stage depends on (all non-runtime keys when None)."""
    return config_hash(dataclasses.asdict(cfg), keys, exclude=RUNTIME_KEYS)


# --- stages 1-3: corpus, tokenizer, tokens ----------------------------------


def build_corpus(cfg: PretrainConfig, work: Path) -> Path:
    """Stage 1: collect the corpus as JSON lines per domain and split."""
    out = work / f"corpus-{stage_hash(cfg, CORPUS_KEYS)}"
    if (out / "manifest.json").exists():
        return out
    max_bytes = {"code": int(cfg.code_max_mb * 1e6), "prose": int(cfg.prose_max_mb * 1e6)}
    corpus = collect_corpus(max_bytes=max_bytes, heldout_mod=cfg.heldout_mod)
    empty = [f"{d}.{s}" for d, splits in corpus.items() for s, docs in splits.items() if not docs]
    if empty:
        raise ValueError(f"no documents in {empty}: raise code_max_mb / prose_max_mb or lower heldout_mod")
    out.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for domain, splits in corpus.items():
        for split, docs in splits.items():
            with open(out / f"{domain}.{split}.jsonl", "w") as f:
                f.writelines(json.dumps(dataclasses.asdict(doc)) + "\n" for doc in docs)
            manifest[f"{domain}.{split}"] = {"files": len(docs), "chars": sum(len(d.text) for d in docs)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def read_documents(corpus_dir: Path, domain: str, split: str) -> list[Document]:
    """The documents of one domain and split from a stage-1 directory."""
    with open(corpus_dir / f"{domain}.{split}.jsonl") as f:
        return [Document(**json.loads(line)) for line in f]


def build_tokenizer_stage(cfg: PretrainConfig, corpus_dir: Path, work: Path) -> Path:
    """Stage 2: train the tokenizer on the train split of every domain."""
    out = work / f"tokenizer-{stage_hash(cfg, TOKENIZER_KEYS)}"
    if not out.exists():
        texts = [doc.text for domain in DOMAINS for doc in read_documents(corpus_dir, domain, "train")]
        partial = out.with_name(out.name + ".partial")  # renamed when complete
        build_tokenizer(texts, cfg.vocab_size, cfg.block_size, partial)
        partial.rename(out)
    return out


def build_tokens(cfg: PretrainConfig, corpus_dir: Path, tokenizer_dir: Path, work: Path) -> Path:
    """Stage 3: one uint16 stream of ``<|bos|> doc <|eos|>`` per domain and split."""
    out = work / f"tokens-{stage_hash(cfg, TOKENIZER_KEYS)}"
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
    """A freshly initialised Llama with tied input / output embeddings."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.block_size,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def learning_rate(cfg: PretrainConfig, step: int, progress: float) -> float:
    """Linear warmup over steps, then cosine decay over ``progress`` in [0, 1]."""
    return cosine_lr(step, progress, cfg.learning_rate, cfg.warmup_steps, cfg.min_lr_ratio)


def sample_batch(stream: torch.Tensor, batch_size: int, block_size: int) -> torch.Tensor:
    """Random windows of a token stream, ``[batch_size, block_size]`` (global torch RNG, so resumable)."""
    starts = torch.randint(0, len(stream) - block_size, (batch_size,))
    return torch.stack([stream[s : s + block_size] for s in starts.tolist()])


@torch.inference_mode()
def heldout_loss(model, streams: dict[str, torch.Tensor], block_size: int, max_tokens: int = 0) -> dict:
    """Mean next-token loss in nats per domain over consecutive windows of each stream.

    Args:
        model: a causal LM.
        streams: ``{domain: LongTensor [num_tokens]}``.
        block_size: window length; the first token of a window is context only.
        max_tokens: use the first ``max_tokens`` tokens of each stream (0 = all).
    """
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    losses = {}
    for domain, stream in streams.items():
        stream = stream[:max_tokens] if max_tokens else stream
        windows = stream[: len(stream) // block_size * block_size].view(-1, block_size)
        total, count = 0.0, 0
        for batch in windows.split(16):
            logits = model(input_ids=batch.to(device)).logits[:, :-1].float()
            targets = batch[:, 1:].to(device)
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            count += targets.numel()
        losses[domain] = {"nats_per_token": total / max(count, 1), "tokens": count}
    model.train(was_training)
    return losses


def train_step(accelerator: Accelerator, model, optimizer, batch: torch.Tensor, cfg: PretrainConfig) -> float:
    """One optimiser step on ``batch`` ``[batch_size, block_size]``; returns the loss."""
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def tokens_seen(state: TrainState, cfg: PretrainConfig, accelerator: Accelerator) -> int:
    """Training tokens so far, over all processes."""
    return state.step * cfg.batch_size * cfg.block_size * accelerator.num_processes


def log_point(state: TrainState, cfg: PretrainConfig, losses: list[float], lr: float, accelerator: Accelerator) -> dict:
    """Append the mean train loss since the last point (over all processes) to the curve."""
    loss = float(accelerator.reduce(torch.tensor([sum(losses) / len(losses)], device=accelerator.device), "mean"))
    tokens = tokens_seen(state, cfg, accelerator)
    point = {"step": state.step, "tokens": tokens, "elapsed_s": round(state.elapsed_s, 1), "lr": lr}
    state.curve.append({**point, "train_loss": loss, "tokens_per_s": round(tokens / state.elapsed_s)})
    return state.curve[-1]


def eval_point(state: TrainState, cfg: PretrainConfig, model, heldout: dict[str, torch.Tensor], accelerator: Accelerator) -> dict:
    """Append the held-out loss per domain (first ``eval_tokens`` tokens) to the curve."""
    losses = heldout_loss(model, heldout, cfg.block_size, cfg.eval_tokens)
    point = {"step": state.step, "tokens": tokens_seen(state, cfg, accelerator), "elapsed_s": round(state.elapsed_s, 1)}
    state.curve.append({**point, "heldout_loss": {d: round(v["nats_per_token"], 4) for d, v in losses.items()}})
    return state.curve[-1]


def train(cfg: PretrainConfig, tokens_dir: Path, tokenizer, run_dir: Path, stop_after_steps: int = 0):
    """Stage 4: the training loop; returns the trained model, or None when stopped early.

    Args:
        cfg: the resolved config.
        tokens_dir: stage-3 directory of token streams.
        tokenizer: the stage-2 tokenizer (vocabulary and special token ids).
        run_dir: checkpoints and the running loss curve; resumed from when present.
        stop_after_steps: simulate an interrupt after this step (checkpoint, then return None).
    """
    accelerator = Accelerator(cpu=multi_process_cpu(), mixed_precision=cfg.mixed_precision)
    set_seed(cfg.seed, device_specific=True)  # each process draws its own batches
    model = build_model(cfg, tokenizer)
    model, optimizer = accelerator.prepare(model, make_adamw(model, cfg.learning_rate, cfg.weight_decay))
    state = TrainState()
    accelerator.register_for_checkpointing(state)
    resume(accelerator, run_dir, state)
    train_stream = torch.cat(list(load_streams(tokens_dir, "train").values()))
    heldout = load_streams(tokens_dir, "heldout")
    bar = tqdm(
        total=cfg.max_steps,
        initial=state.step,
        desc="pretrain",
        disable=not accelerator.is_local_main_process,
        mininterval=1 if sys.stderr.isatty() else 60,
    )
    started, losses = time.time() - state.elapsed_s, []
    try:
        done = all_agree(state.progress(cfg.max_steps, cfg.max_minutes) >= 1.0, accelerator)
        while not done:
            # data
            lr = learning_rate(cfg, state.step, state.progress(cfg.max_steps, cfg.max_minutes))
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = sample_batch(train_stream, cfg.batch_size, cfg.block_size).to(accelerator.device)
            # step
            losses.append(train_step(accelerator, model, optimizer, batch, cfg))
            state.step, state.elapsed_s = state.step + 1, time.time() - started
            bar.update(1)
            # log
            done = all_agree(state.progress(cfg.max_steps, cfg.max_minutes) >= 1.0, accelerator)  # time may run out on one process first
            if state.step % cfg.log_every == 0 or done:
                point = log_point(state, cfg, losses, lr, accelerator)
                bar.set_postfix(loss=f"{point['train_loss']:.3f}", tok_s=point["tokens_per_s"])
                losses = []
            if state.step % cfg.eval_every == 0 or done:
                accelerator.print(json.dumps(eval_point(state, cfg, model, heldout, accelerator)), flush=True)
            # checkpoint
            if state.step % cfg.checkpoint_every == 0 or done or state.step == stop_after_steps:
                save_checkpoint(accelerator, run_dir, state, cfg.keep_checkpoints)
            if state.step == stop_after_steps:
                return None
    except KeyboardInterrupt:
        save_checkpoint(accelerator, run_dir, state, cfg.keep_checkpoints)
        raise
    finally:
        bar.close()
    return accelerator.unwrap_model(model)


# --- export ------------------------------------------------------------------


def export(cfg: PretrainConfig, model, tokenizer, curve: list[dict], tokens_dir: Path) -> Path:
    """Write the shipped directory and measure held-out loss on the saved weights, loaded in fp32."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.to(getattr(torch, cfg.save_dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    (out / "loss_curve.json").write_text(json.dumps(curve))
    plot_curve(curve, out / "loss_curve.png", title="demo target pretraining")
    shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    losses = heldout_loss(shipped, load_streams(tokens_dir, "heldout"), cfg.block_size)
    (out / "heldout_loss.json").write_text(json.dumps(losses, indent=1) + "\n")
    return out


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


def run(cfg: PretrainConfig, stop_after_steps: int = 0) -> Path | None:
    """Run (or skip) every stage; returns ``output_dir``, or None when stopped early.

    Args:
        cfg: the resolved config.
        stop_after_steps: simulate an interrupt after this training step (0 = never).
    """
    if is_exported(cfg):
        print(f"{cfg.output_dir} already holds this config's model; nothing to do")
        return Path(cfg.output_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or threads)
    try:
        work = Path(cfg.work_dir)
        processes = PartialState(cpu=multi_process_cpu())
        with processes.main_process_first():  # the first process builds the cached stages, the others read them
            corpus_dir = build_corpus(cfg, work)
            tokenizer_dir = build_tokenizer_stage(cfg, corpus_dir, work)
            tokens_dir = build_tokens(cfg, corpus_dir, tokenizer_dir, work)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        run_dir = work / f"run-{stage_hash(cfg)}"
        model = train(cfg, tokens_dir, tokenizer, run_dir, stop_after_steps)
        if model is None:
            return None
        if processes.is_main_process:
            curve = json.loads((run_dir / "loss_curve.json").read_text())
            export(cfg, model, tokenizer, curve, tokens_dir)
        processes.wait_for_everyone()
        return Path(cfg.output_dir)
    finally:
        torch.set_num_threads(threads)  # leave the caller's setting as it was


def main(argv: list[str] | None = None) -> None:
    """Command line: ``--config recipe.yaml key=value ...``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="YAML recipe (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of recipe keys")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    sigterm_as_interrupt()  # kill = Ctrl-C: checkpoint, then exit
    out = run(cfg)
    if out is not None and first_process():
        print(json.dumps(json.loads((out / "heldout_loss.json").read_text())))


if __name__ == "__main__":
    main()
