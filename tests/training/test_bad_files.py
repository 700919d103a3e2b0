"""Bad files and unwritable outputs are refused before any slow work, in one line naming them."""

from __future__ import annotations

import pytest
import yaml
from bad_input import assert_one_line_naming

import draftsmith.training.train as train_module
from draftsmith.proposers.core.errors import InputError
from draftsmith.training.demo.run import run_demo
from draftsmith.training.recipe import load_config
from draftsmith.training.train import run
from draftsmith.verify.evaluation.evaluate import EvalConfig, evaluate

from tiny_recipe import REPO, recipe_overrides

BAD_DATA = {
    "empty.jsonl": (b"", "is empty"),  # datasets raised StopIteration
    "blank.txt": (b"  \n\n", "is empty"),
    "latin1.txt": ("caf\u00e9 cr\u00e8me".encode("latin-1"), "is not UTF-8 text"),
    "binary.txt": (b"\x7fELF\x00\x01\x02", "looks binary"),
    "broken.jsonl": (b'{"text": "a"}\n{"text": \n', "broken.jsonl:2 is not valid JSON"),
    "list.jsonl": (b'{"text": "a"}\n[1, 2]\n', "list.jsonl:2 must hold a JSON object"),
}


@pytest.fixture
def no_target(monkeypatch):
    """Fail the test if training gets as far as loading the target."""
    monkeypatch.setattr(train_module, "load_frozen_target", lambda *a, **k: pytest.fail("the target was loaded before the check"))


@pytest.mark.parametrize("name", sorted(BAD_DATA))
def test_a_bad_data_file_is_named_before_the_target_loads(name, no_target, target_dir, text_file, tmp_path):
    content, message = BAD_DATA[name]
    bad = tmp_path / name
    bad.write_bytes(content)
    cfg = load_config(
        REPO / "recipes" / "training" / "distill_draft_full.yaml",
        recipe_overrides(target_dir, text_file, tmp_path, f"data.eval_files=[{bad}]"),
    )
    with pytest.raises(InputError, match=message) as caught:
        run(cfg)
    assert_one_line_naming(caught.value, str(bad))


@pytest.mark.parametrize("key", ["output_dir", "run_dir"])
def test_an_unwritable_output_is_named_before_training(key, no_target, target_dir, text_file, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = load_config(
        REPO / "recipes" / "training" / "distill_draft_full.yaml",
        recipe_overrides(target_dir, text_file, tmp_path, f"{key}={blocker}/sub/dir"),
    )
    with pytest.raises(InputError, match="not writable") as caught:
        run(cfg)
    assert_one_line_naming(caught.value, str(blocker))


def test_an_unwritable_eval_output_is_named_before_decoding(tiny_target_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("draftsmith.verify.evaluation.evaluate.load_target", lambda *a, **k: pytest.fail("loaded the target first"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    config = EvalConfig(target=str(tiny_target_dir), domains={"d": str(tmp_path)}, output_dir=str(blocker / "out"))
    with pytest.raises(InputError, match="output_dir .* is not writable"):
        evaluate(config)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_prompts": 0}, "num_prompts must be an integer >= 1, got 0"),  # blamed the corpus
        ({"num_prompts": -1}, "num_prompts must be an integer >= 1, got -1"),  # ran 165 prompts
        ({"max_new_tokens": 300}, r"max_new_tokens=300 leaves no room for a prompt in the demo target's 256 positions"),
    ],
)
def test_demo_arguments_are_checked(kwargs, message, tmp_path, monkeypatch):
    monkeypatch.setattr("draftsmith.training.demo.run.heldout_documents", lambda *a: pytest.fail("went on to the corpus"))
    block = yaml.safe_load((REPO / "recipes" / "models" / "demo_target" / "config.json").read_text())["max_position_embeddings"]
    if "max_new_tokens" in kwargs:
        kwargs = {"max_new_tokens": block + 44}
        message = rf"max_new_tokens={block + 44} leaves no room for a prompt in the demo target's {block} positions"
    with pytest.raises(InputError, match=message):
        run_demo(output_dir=str(tmp_path / "demo"), **kwargs)
