"""Property-based: a training recipe with any overrides either resolves or fails in one line naming the key.

The overrides are what a user types (``key=value``, ``section.key=value``): the recipe's
real keys, the draft family's keys and unknown ones, with values YAML parses to anything.
"""

from __future__ import annotations

import dataclasses

from bad_input import ANY_VALUE, ODD_KEYS, assert_one_line_naming, yaml_text
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.proposers.core.errors import InputError
from draftsmith.training.draft_lm import DraftInit, LoraSettings
from draftsmith.training.recipe import TrainConfig, load_config

from tiny_recipe import REPO

RECIPE = REPO / "recipes" / "training" / "distill_draft_full.yaml"


def dotted_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type if not isinstance(f.type, str) else None):
            keys += dotted_keys(f.type, f"{prefix}{f.name}.")
        keys.append(prefix + f.name)
    return keys


KEYS = (
    [k for k in dotted_keys(TrainConfig) if k not in ("draft",)]
    + ["data.block_size", "data.format", "data.self_distill.enabled", "capture.mode", "capture.max_gb"]
    + [f"draft.init.{f.name}" for f in dataclasses.fields(DraftInit)]
    + [f"draft.lora.{f.name}" for f in dataclasses.fields(LoraSettings)]
    + ["draft.loss", "draft.temperature", "draft.pretrained"]
)
PLAUSIBLE = st.one_of(st.integers(min_value=-2, max_value=64), st.floats(min_value=-1, max_value=2), st.booleans(), st.text(max_size=5))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.one_of(st.sampled_from(KEYS), ODD_KEYS), st.one_of(PLAUSIBLE, ANY_VALUE)), min_size=1, max_size=3))
def test_overrides_resolve_or_name_the_bad_key(pairs):
    overrides = [f"{key}={yaml_text(value)}" for key, value in pairs]
    try:
        cfg = load_config(RECIPE, overrides)
    except (InputError, FileNotFoundError) as err:
        parts = [key.strip().split(".") for key, _ in pairs]
        prefixes = [".".join(p[:i]) for p in parts for i in range(1, len(p) + 1)]  # an unknown section is named as such
        assert_one_line_naming(err, *prefixes, *(p[-1] for p in parts), "override")
        return
    # accepted: typed as declared
    assert isinstance(cfg.batch_size, int) and cfg.batch_size >= 1 and isinstance(cfg.learning_rate, float)
    assert isinstance(cfg.data.train_files, list) and all(isinstance(f, str) for f in cfg.data.train_files)
