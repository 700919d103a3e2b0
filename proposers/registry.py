"""The proposer families by ``type:`` name, and the one function that builds a proposer from its config.

A family is registered by its module path, imported only when a config names it, so that
loading an n-gram proposer never imports the heads' modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .core.config import build, read_config, resolve_type
from .core.proposer import Proposer

#: proposer type name -> "module:Class"; the class's constructor is the config's schema.
REGISTRY: dict[str, str] = {
    "ngram": "draftsmith.proposers.ngram:NgramProposer",
    "draft_model": "draftsmith.proposers.draft_model:DraftModelProposer",
    "medusa": "draftsmith.proposers.medusa:MedusaProposer",
    "eagle": "draftsmith.proposers.eagle:EagleProposer",
    "dflash": "draftsmith.proposers.dflash:DFlashProposer",
    "mtp": "draftsmith.proposers.mtp:MtpProposer",
    "suffix": "draftsmith.proposers.suffix:SuffixProposer",
    "composite": "draftsmith.proposers.composite:CompositeProposer",
}


def load_proposer(config: Mapping[str, Any] | str | Path, target=None, tokenizer=None) -> Proposer:
    """Build the proposer a config describes.

    Args:
        config: ``{"type": name, **constructor arguments}`` or the path of a YAML file
            holding that mapping.
        target: the target model, passed to constructors that take a ``target`` argument
            (vocabulary checks, hidden sizes); it is not a config key.
        tokenizer: the target's tokenizer, passed to constructors that take a ``tokenizer``
            argument (a saved suffix store's check); not a config key either.
    """
    values = read_config(config, what="proposer config")
    cls = resolve_type(values, REGISTRY, "proposer")
    where = f"proposer type {values['type']!r}"
    return build(cls, {k: v for k, v in values.items() if k != "type"}, where, inject={"target": target, "tokenizer": tokenizer})
