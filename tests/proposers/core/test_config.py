"""The one config loader: proposer configs, eval configs and training recipes all go through it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import pytest
import yaml

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.config import apply_overrides, build, load, read_yaml
from draftsmith.proposers.core.errors import ConfigError


@dataclass
class Inner:
    width: int = 2
    names: list[str] = field(default_factory=list)


@dataclass
class Outer:
    rate: float = 0.1
    mode: Literal["fast", "exact"] = "exact"
    limit: int | None = None
    flag: bool = False
    inner: Inner = field(default_factory=Inner)


def test_values_are_checked_against_the_schema_types():
    cfg = build(Outer, {"rate": 1, "mode": "fast", "limit": 3, "flag": True, "inner": {"width": 4, "names": "a"}})
    assert cfg == Outer(rate=1.0, mode="fast", limit=3, flag=True, inner=Inner(width=4, names=["a"]))
    assert build(Outer, {"rate": "1e-3"}).rate == 1e-3  # YAML 1.1 reads 1e-3 as a string
    bad = {
        "rate": ("fast", r"'rate': expected float, got 'fast'"),
        "mode": ("slow", r"'mode': 'slow' is not one of \['fast', 'exact'\]"),
        "limit": (2.5, r"'limit': expected int or None, got 2.5"),
        "flag": ("no", r"'flag': expected bool, got 'no'"),  # a string is never read as a boolean
        "inner": (3, r"'inner': expected a mapping of Inner keys, got 3"),
    }
    for key, (value, message) in bad.items():
        with pytest.raises(ConfigError, match=message):
            build(Outer, {key: value}, where="test")
    with pytest.raises(ConfigError, match=r"test: key 'inner.width': expected int, got True"):
        build(Outer, {"inner": {"width": True}}, where="test")


def test_unknown_and_missing_keys_list_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['inner.depth'\]; valid keys: \['inner.width', 'inner.names'\]"):
        build(Outer, {"inner": {"depth": 1}})

    def needs(model: str, k: int = 4, target=None):
        return model, k, target

    with pytest.raises(ConfigError, match=r"missing required key\(s\) \['model'\]"):
        build(needs, {"k": 2})
    assert build(needs, {"model": "m"}, inject={"target": "T"}) == ("m", 4, "T")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['target'\]"):  # injected arguments are not config keys
        build(needs, {"model": "m", "target": "x"}, inject={"target": None})


def test_overrides_reach_nested_sections_and_files_are_named_in_errors(tmp_path):
    assert apply_overrides({"inner": {"width": 1}}, ["inner.width=5", "rate=0.5"]) == {"inner": {"width": 5}, "rate": 0.5}
    with pytest.raises(ConfigError, match="is not key=value"):
        apply_overrides({}, ["rate"])
    path = tmp_path / "broken.yaml"
    path.write_text("rate: [1, 2\nmode: fast\n")
    with pytest.raises(ConfigError, match=rf"{path} is not valid YAML at line \d+"):
        read_yaml(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping of keys, got list"):
        load(Outer, path)
    path.write_text(yaml.safe_dump({"rate": 0.2, "inner": {"width": 3}}))
    assert load(Outer, path, ["inner.names=[x, y]"]) == Outer(rate=0.2, inner=Inner(width=3, names=["x", "y"]))
    # an override of an unknown key is named whole, with its section (CI drew ``0.0=``: the error named only '0')
    for override, key in (("0.0=", "0"), ("innr.width=3", "innr"), ("rat=1", "rat")):
        with pytest.raises(ConfigError, match=rf"override '{re.escape(override)}' sets unknown key '{key}'"):
            load(Outer, path, [override])


def test_proposer_configs_are_their_constructors():
    """No copy of a constructor's signature: the loader reads the constructor itself."""
    proposer = load_proposer({"type": "ngram", "k": 3, "max_nodes": None})
    assert (proposer.k, proposer.max_nodes) == (3, 3)
    with pytest.raises(ConfigError, match=r"proposer type 'ngram': key 'k': expected int, got 2.5"):
        load_proposer({"type": "ngram", "k": 2.5})
    with pytest.raises(ConfigError, match=r"proposer type 'draft_model': missing required key\(s\) \['model'\]"):
        load_proposer({"type": "draft_model"})
    with pytest.raises(ConfigError, match=r"proposer type 'ngram': need 1 <= min_n <= max_n"):  # the constructor's own check
        load_proposer({"type": "ngram", "min_n": 3, "max_n": 2})
