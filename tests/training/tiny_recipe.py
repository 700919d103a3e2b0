"""The tiny training setup shared by the training tests: the text, and overrides that shrink a recipe to it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEXT = "".join(
    f"def f{i}(x):\n    return x * {i} + {i % 7}\n\nThe fox number {i} jumps over the lazy dog {i % 5} times.\n" for i in range(60)
)


def recipe_overrides(target_dir: Path, text_file: Path, root: Path, *extra: str) -> list[str]:
    """Overrides that shrink the draft-LM recipe to the tiny target and text file (a few seconds per run)."""
    return [
        f"target={target_dir}",
        f"output_dir={root / 'out'}",
        f"run_dir={root / 'run'}",
        f"data.train_files=[{text_file}]",
        "data.eval_files=[]",
        "data.block_size=32",
        "draft.init.num_layers=1",
        "draft.init.hidden_size=32",
        "draft.init.intermediate_size=64",
        "draft.init.num_heads=4",
        "draft.init.num_kv_heads=2",
        "batch_size=4",
        "learning_rate=0.01",
        "warmup_steps=2",
        "log_every=1",
        "checkpoint_every=100",
        "threads=1",
        *extra,
    ]
