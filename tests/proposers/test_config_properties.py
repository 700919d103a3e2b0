"""Property-based: every proposer config either builds a proposer that decodes losslessly, or fails in one line naming the key.

Generated configs mix the family's real keys with unknown ones, and plausible values with
anything YAML or a caller may produce (floats for ints, strings for booleans, inf, nan,
lists...). Deterministic: hypothesis runs derandomized.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from bad_input import ANY_VALUE, ODD_KEYS, assert_one_line_naming
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftsmith.proposers import REGISTRY, load_proposer, mtp_head
from draftsmith.proposers.core.config import resolve_type
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.dflash_head import dflash_config_for_target, dflash_for_target
from draftsmith.proposers.eagle_head import config_for_target, draft_for_target
from draftsmith.proposers.medusa_head import MedusaHeads, write_calibration
from draftsmith.verify import SpeculativeDecoder

PLAUSIBLE = st.one_of(st.integers(min_value=-1, max_value=7), st.floats(min_value=0.0, max_value=1.0), st.booleans(), st.none())
PROMPT = torch.tensor([[1, 5, 9, 5, 9, 5, 9, 3]])


@pytest.fixture(scope="module")
def setup(make_llama, tmp_path_factory):
    """The target, the required keys of each family that has some (a ``model`` directory, members), and plain greedy output."""
    target = make_llama(seed=0)
    draft_dir = tmp_path_factory.mktemp("draft")
    make_llama(seed=5, layers=1).save_pretrained(draft_dir)
    heads_dir = tmp_path_factory.mktemp("medusa")
    MedusaHeads.for_target(target, num_heads=3).save(heads_dir)
    write_calibration(heads_dir, [[0.5, 0.2], [0.3, 0.1], [0.2, 0.1]], tokens=100, max_nodes=4)
    eagle_dir = tmp_path_factory.mktemp("eagle")
    draft_for_target(config_for_target(target, 1), target).save(eagle_dir)
    mtp_dir = tmp_path_factory.mktemp("mtp")
    mtp_head.modules_for_target(mtp_head.config_for_target(target, 2), target).save(mtp_dir)
    dflash_dir = tmp_path_factory.mktemp("dflash")
    dflash_for_target(dflash_config_for_target(target, block_size=4, num_layers=1), target).save(dflash_dir)
    plain = SpeculativeDecoder(target).generate(PROMPT, max_new_tokens=8).new_tokens
    required = {
        kind: {"model": str(path)}
        for kind, path in (
            ("draft_model", draft_dir),
            ("medusa", heads_dir),
            ("eagle", eagle_dir),
            ("mtp", mtp_dir),
            ("dflash", dflash_dir),
        )
    }
    required["composite"] = {"proposers": [{"type": "suffix"}, {"type": "draft_model", "model": str(draft_dir), "k": 2}]}
    return target, required, plain


def config_strategy(kind: str):
    schema = inspect.signature(resolve_type({"type": kind}, REGISTRY, "proposer")).parameters
    valid = [p for p in schema if p not in ("target", "tokenizer", "model", "proposers")]
    keys = st.one_of(st.sampled_from(valid), ODD_KEYS)
    return st.dictionaries(keys, st.one_of(PLAUSIBLE, ANY_VALUE), max_size=3)


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_a_config_builds_a_lossless_proposer_or_names_its_bad_key(kind, setup):
    target, required, plain = setup

    @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(config_strategy(kind))
    def check(extra):
        config = {"type": kind, **required.get(kind, {}), **extra}
        try:
            proposer = load_proposer(config, target=target)
        except (InputError, FileNotFoundError) as err:
            assert_one_line_naming(err, *extra)
            return
        # accepted: it must decode, token-identical to plain greedy decoding
        assert SpeculativeDecoder(target, proposer, adaptive=False).generate(PROMPT, max_new_tokens=8).new_tokens == plain

    check()


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.one_of(ANY_VALUE, st.dictionaries(ODD_KEYS, ANY_VALUE, max_size=2)))
def test_a_config_that_is_not_a_proposer_mapping_is_refused_in_one_line(value):
    with pytest.raises((InputError, FileNotFoundError)) as caught:
        load_proposer(value if not isinstance(value, dict) else {"type": value.get("type", "nope"), **value})
    assert_one_line_naming(caught.value, "type", "config", "does not exist", "proposer")
