"""The proposer contract: the defaults of ProposerBase, and an object that lacks a member refused by name."""

from __future__ import annotations

import pytest

from draftsmith.proposers import REGISTRY, ProposerBase
from draftsmith.proposers.core.config import resolve_type
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.proposer import Proposer, check_proposer
from draftsmith.proposers.core.types import Draft
from draftsmith.verify import SpeculativeDecoder


class Minimal(ProposerBase):
    def begin(self, prompt, features):
        pass

    def propose(self, context):
        return Draft.empty()

    def observe(self, result, features):
        pass


class Bare:
    hidden_layers = ()

    def propose(self, context):
        return Draft.empty()


def test_the_base_gives_every_optional_member_a_default(tmp_path):
    proposer = check_proposer(Minimal())
    assert isinstance(proposer, Proposer) and proposer.vocab_size is None and proposer.hidden_layers == ()
    assert proposer.transformers_peer() is None and proposer.reset() is None
    assert proposer.export_controls(None, tmp_path) == []
    with pytest.raises(InputError, match="Minimal has no engine export"):
        proposer.export(tmp_path / "out")


def test_every_family_is_a_proposer_through_the_base():
    for kind in REGISTRY:
        assert issubclass(resolve_type({"type": kind}, REGISTRY, "proposer"), ProposerBase), kind


def test_an_object_that_lacks_a_member_is_refused_naming_what_it_lacks(make_llama):
    with pytest.raises(
        InputError, match=r"Bare is not a Proposer: it lacks \['begin', 'draft_depth', 'draft_width', 'export', .*'vocab_size'\]"
    ):
        SpeculativeDecoder(make_llama(seed=0), Bare(), adaptive=False)
    assert SpeculativeDecoder(make_llama(seed=0), Minimal(), adaptive=False).proposer is not None
