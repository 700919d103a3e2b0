"""EAGLE-3 heads over the target's whole vocabulary: no d2t / t2d in their checkpoints and exports (vLLM refuses a
d2t for them: its model has no map to load it into), earlier checkpoints with identity maps still load, others are refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.eagle import EagleProposer
from draftsmith.proposers.eagle_head import config_for_target, draft_for_target


@pytest.fixture(scope="module")
def target(make_llama):
    return make_llama(layers=6, seed=7)


def whole_vocabulary_head(target):
    torch.manual_seed(0)
    return draft_for_target(config_for_target(target, 3, aux_layers=[2, 3, 5]), target).eval()


def test_a_whole_vocabulary_head_exports_and_saves_without_maps(target, tmp_path):
    proposer = EagleProposer(whole_vocabulary_head(target), target=target, k=3)
    proposer.export(tmp_path / "out")
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "d2t" not in written and "t2d" not in written and "fc.weight" in written
    reloaded = EagleProposer(tmp_path / "out", target=target, k=3)
    assert not reloaded.draft.d2t.any() and reloaded.draft.t2d.all()
    for name, tensor in proposer.draft.state_dict().items():
        assert torch.equal(reloaded.draft.state_dict()[name], tensor), name


def test_identity_maps_of_an_earlier_checkpoint_load_and_other_maps_are_refused(target, tmp_path):
    head = whole_vocabulary_head(target)
    head.save(tmp_path / "h")
    path = tmp_path / "h" / "model.safetensors"
    tensors = load_file(str(path))
    save_file({**tensors, "d2t": torch.zeros(128, dtype=torch.long), "t2d": torch.ones(128, dtype=torch.bool)}, str(path))
    assert EagleProposer(tmp_path / "h", target=target).draft.t2d.all()  # as earlier versions wrote it
    shifted = torch.zeros(128, dtype=torch.long)
    shifted[:5] = 1
    save_file({**tensors, "d2t": shifted, "t2d": torch.ones(128, dtype=torch.bool)}, str(path))
    with pytest.raises(InputError, match="whole vocabulary has d2t / t2d that are not the identity"):
        EagleProposer(tmp_path / "h", target=target)
