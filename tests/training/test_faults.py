"""Fault injection: SIGKILL while a checkpoint or the final export is being written loses nothing.

A driver process trains the tiny recipe and kills itself with SIGKILL at the N-th Python
line executed inside ``save_checkpoint`` or the final ``export`` (N drawn with a fixed
seed from the lines those calls run, so the kill lands anywhere in them: in accelerate's
``save_state``, in safetensors, between the renames). After every kill:

- each checkpoint directory that exists is complete (a killed save leaves only its
  temporary directory), and ``output_dir`` is absent or a complete, loadable export;
- running the same recipe again finishes, with the weights of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from draftsmith.training.recipe import load_config
from draftsmith.training.train import run

from tiny_recipe import REPO, recipe_overrides

DRIVER = r"""
import json, os, signal, sys
import draftsmith.training.loop as loop
import draftsmith.training.train as train

phase, kill_at = sys.argv[1], int(sys.argv[2])
config, overrides = sys.argv[3], sys.argv[4:]
lines = 0


def tracer(frame, event, arg):
    global lines
    if event == "line":
        lines += 1
        if lines == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    return tracer


def traced(function):
    def wrapper(*args, **kwargs):
        sys.settrace(tracer)
        try:
            return function(*args, **kwargs)
        finally:
            sys.settrace(None)
    return wrapper


module, name = {"checkpoint": (loop, "save_checkpoint"), "export": (train, "export")}[phase]
setattr(module, name, traced(getattr(module, name)))
train.run(train.load_config(config, overrides))
print(json.dumps({"lines": lines}))
"""
SEED = 20261130
KILLS = [pytest.param(0), pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]  # seeded kill points per phase


def drive(script: Path, phase: str, kill_at: int, overrides: list[str]) -> subprocess.CompletedProcess:
    config = str(REPO / "recipes" / "training" / "distill_draft_full.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(script), phase, str(kill_at), config, *overrides], capture_output=True, text=True, env=env, timeout=300
    )


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_all_old_or_all_new(out: Path, old: Path, new: Path) -> None:
    """``out`` holds the old export or the new one, never a mix: every file that tells them apart sides with one of them.

    ``new`` is another run of the new recipe: files that old and new share byte for byte
    (tokenizer, model config) tell nothing; the rest (weights, resolved recipe, curves) do.
    """
    found, old_files, new_files = files(out), files(old), files(new)
    telling = [name for name in set(old_files) | set(new_files) if old_files.get(name) != new_files.get(name)]
    sides = {name: found.get(name) == old_files.get(name) for name in telling}
    assert len(set(sides.values())) == 1, f"old and new files mixed in {out}: {sides}"
    expected = old_files if next(iter(sides.values())) else new_files
    assert set(found) == set(expected), f"{out} holds {sorted(set(found) ^ set(expected))} that its export does not"


def assert_nothing_half_written(run_dir: Path, out: Path) -> None:
    for checkpoint in (run_dir / "checkpoints").glob("step_*"):
        names = {p.name for p in checkpoint.iterdir()}
        assert {"model.safetensors", "optimizer.bin", "training_config.yaml"} <= names, (checkpoint, names)
        assert load_file(checkpoint / "model.safetensors")  # complete, readable tensors
    if out.exists():
        assert (out / "loss_curve.json").is_file() and json.loads((out / "loss_curve.json").read_text())
        AutoModelForCausalLM.from_pretrained(out)  # complete and loadable


EXTRA = ("max_steps=4", "checkpoint_every=2", "keep_checkpoints=1")


@pytest.fixture(scope="module")
def reference(target_dir, text_file, tmp_path_factory):
    """The uninterrupted run's output, the driver script, and (per phase, filled lazily) the lines a dry run traces."""
    root = tmp_path_factory.mktemp("faults")
    whole = run(
        load_config(
            REPO / "recipes" / "training" / "distill_draft_full.yaml", recipe_overrides(target_dir, text_file, root / "whole", *EXTRA)
        )
    )
    other = run(
        load_config(
            REPO / "recipes" / "training" / "distill_draft_full.yaml",
            recipe_overrides(target_dir, text_file, root / "other", *EXTRA, "seed=1"),
        )
    )
    script = root / "driver.py"
    script.write_text(DRIVER)
    return {"root": root, "whole": whole, "other": other, "script": script, "lines": {}}


def traced_lines(reference, phase: str, target_dir, text_file) -> int:
    if phase not in reference["lines"]:
        dry = drive(reference["script"], phase, 0, recipe_overrides(target_dir, text_file, reference["root"] / f"dry_{phase}", *EXTRA))
        assert dry.returncode == 0, dry.stderr[-3000:]
        reference["lines"][phase] = json.loads(dry.stdout.strip().splitlines()[-1])["lines"]
    return reference["lines"][phase]


@pytest.mark.parametrize("kill", KILLS)
@pytest.mark.parametrize("phase", ["checkpoint", "export"])
def test_sigkill_while_writing_loses_nothing(phase, kill, reference, target_dir, text_file, tmp_path):
    lines = traced_lines(reference, phase, target_dir, text_file)
    assert lines > 100
    kill_at = random.Random(f"{SEED}:{phase}:{kill}").randrange(1, lines)
    overrides = recipe_overrides(target_dir, text_file, tmp_path, *EXTRA, "overwrite=true")  # replacing another seed's export
    out = tmp_path / "out"
    if phase == "export":  # an earlier export (another seed) sits in output_dir: the new one must never mix with it
        shutil.copytree(reference["other"], out)
    killed = drive(reference["script"], phase, kill_at, overrides)
    assert killed.returncode == -9, (kill_at, killed.returncode, killed.stderr[-2000:])
    assert_nothing_half_written(tmp_path / "run", out)
    if phase == "export":
        assert_all_old_or_all_new(out, old=reference["other"], new=reference["whole"])
    again = run(load_config(REPO / "recipes" / "training" / "distill_draft_full.yaml", overrides))
    expected = load_file(reference["whole"] / "model.safetensors")
    for name, tensor in load_file(again / "model.safetensors").items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6, msg=f"killed at line {kill_at} of {lines}")
