"""The offline demo: a target trained on this machine's text, evaluated per domain.

``draftsmith demo`` uses the shipped target in ``recipes/models/demo_target/`` (or trains one
with ``recipes/training/demo_target.yaml`` when it is missing; ``--quick`` trains the
minutes-long quick profile instead), and hands the target's *held-out* documents to the
demo's evaluation (``verify.evaluation.demo``: the domains and the proposers).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from draftsmith.training.demo import pretrain
from draftsmith.training.demo.corpus import Document
from draftsmith.verify.evaluation.demo import DEMO_TARGET, check_demo_settings, evaluate_demo

TRAINING_RECIPES = Path("recipes/training")


def ensure_target(quick: bool) -> Path:
    """The target directory: shipped, or trained now (the quick profile with ``quick``)."""
    if not quick and (DEMO_TARGET / "model.safetensors").is_file():
        return DEMO_TARGET
    recipe = TRAINING_RECIPES / ("demo_target_quick.yaml" if quick else "demo_target.yaml")
    if not quick:
        print(f"{DEMO_TARGET} is missing: training it with {recipe} (about an hour on 2 CPU cores)")
    # the shipped place, told explicitly: the recipe itself writes under outputs/, as every recipe does
    out = pretrain.run(pretrain.load_config(recipe, [] if quick else [f"output_dir={DEMO_TARGET}"]))
    if out is None:
        raise RuntimeError(f"training with {recipe} stopped before the end; run the demo again to resume")
    return out


def heldout_documents(target_dir: Path) -> dict[str, list[Document]]:
    """The held-out documents of the target's own training corpus (same split, never trained on)."""
    cfg = pretrain.config_from_dict(yaml.safe_load((target_dir / "training_config.yaml").read_text()))
    corpus_dir = pretrain.build_corpus(cfg, Path(cfg.work_dir))
    return {domain: pretrain.read_documents(corpus_dir, domain, "heldout") for domain in ("code", "prose")}


def run_demo(
    quick: bool = False, output_dir: str = "outputs/demo", num_prompts: int = 8, max_new_tokens: int = 64, domains_only: bool = False
) -> dict:
    """Build or reuse the target, write the domains, run the evaluation; return its summary (``domains_only``: the domain files)."""
    check_demo_settings(output_dir, num_prompts, max_new_tokens)
    target_dir = ensure_target(quick)
    return evaluate_demo(target_dir, lambda: heldout_documents(target_dir), output_dir, num_prompts, max_new_tokens, domains_only)
