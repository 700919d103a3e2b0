"""Every shipped recipe parses: proposer configs load, eval configs validate, pretrain recipes resolve."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.proposers import load_proposer
from draftsmith.training.demo.pretrain import load_config
from draftsmith.verify.evaluation.evaluate import EvalConfig

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize("path", sorted((RECIPES / "proposers").glob("*.yaml")), ids=lambda p: p.name)
def test_proposer_recipes_load(path):
    from draftsmith.verify import load_target

    target = load_target(RECIPES / "models" / "demo_target")[0]  # the trained heads' recipes draft for the shipped target
    assert load_proposer(path, target=target) is not None


def test_every_family_has_a_ready_proposer_config():
    import yaml

    from draftsmith.proposers import REGISTRY

    kinds = {yaml.safe_load(p.read_text())["type"] for p in (RECIPES / "proposers").glob("*.yaml")}
    assert kinds == set(REGISTRY), sorted(set(REGISTRY) - kinds)


def test_the_ngram_config_exports_as_vllm_drafts_without_a_warning(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the old one warned: it did not draft as the engine does
        export = load_proposer(RECIPES / "proposers" / "ngram.yaml").export(tmp_path / "ngram")
    assert export.speculative_config["method"] == "ngram"


@pytest.mark.parametrize("path", sorted((RECIPES / "eval").glob("engine_check_*.yaml")), ids=lambda p: p.name)
def test_engine_check_recipes_validate(path):
    from draftsmith.verify.evaluation.engine_check import EngineCheckConfig

    config = EngineCheckConfig.from_yaml(path)
    assert config.proposers and config.engine.requirements


@pytest.mark.parametrize("path", sorted((RECIPES / "eval").glob("engine_bench_*.yaml")), ids=lambda p: p.name)
def test_engine_bench_recipes_validate(path):
    from draftsmith.verify.evaluation.engine_bench import EngineBenchConfig

    config = EngineBenchConfig.from_yaml(path)
    assert config.proposers and len(config.concurrency) >= 2


@pytest.mark.parametrize(
    "path",
    sorted(p for p in (RECIPES / "eval").glob("*.yaml") if not p.name.startswith(("engine_check", "engine_bench"))),
    ids=lambda p: p.name,
)
def test_eval_recipes_validate(path):
    assert EvalConfig.from_yaml(path).domains


@pytest.mark.parametrize("path", sorted((RECIPES / "training").glob("demo_target*.yaml")), ids=lambda p: p.name)
def test_pretrain_recipes_resolve(path):
    assert load_config(path).num_layers >= 1


def test_every_recipe_header_shows_its_command():
    written_by_hand = [p for p in RECIPES.rglob("*.yaml") if not (p.parent / "config.json").exists()]  # not a model export
    assert written_by_hand
    for path in written_by_hand:
        head = path.read_text().splitlines()[:12]
        assert any(
            ("draftsmith " in line or "accelerate launch" in line or "python -m" in line) for line in head if line.startswith("#")
        ), path


def _training_recipes() -> list[Path]:
    import yaml

    from draftsmith.training.objective import OBJECTIVES

    return [p for p in sorted((RECIPES / "training").glob("*.yaml")) if (yaml.safe_load(p.read_text()) or {}).get("type") in OBJECTIVES]


@pytest.mark.parametrize("path", _training_recipes(), ids=lambda p: p.name)
def test_training_recipes_build_their_objective(path):
    from draftsmith.training.recipe import load_config, make_objective

    objective = make_objective(load_config(path))  # every draft: key is one the family takes, of its type
    assert objective.needs_logits or objective.hidden_layers


def test_recipes_are_grouped_by_kind():
    """Training recipes, eval configs, proposer configs and shipped models each in their own folder, nothing loose."""
    assert sorted(p.name for p in RECIPES.iterdir()) == ["eval", "models", "proposers", "training"]
    for model in (RECIPES / "models").iterdir():
        assert (model / "config.json").is_file() and (model / "model.safetensors").is_file(), model
    assert all((p.parent / "config.json").exists() is False for p in (RECIPES / "training").glob("*.yaml"))
