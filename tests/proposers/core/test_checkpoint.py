"""One checkpoint reader and one fits-this-target check for every family's heads."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.proposers.core.checkpoint import check_fits_target, check_tensors, read_checkpoint
from draftsmith.proposers.core.errors import InputError


def head_dir(tmp_path, config='{"num_heads": 2}', tensors=None):
    directory = tmp_path / "head"
    directory.mkdir()
    (directory / "config.json").write_text(config)
    if tensors is not None:
        save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_a_head_directory_is_read_whole(tmp_path):
    checkpoint = read_checkpoint(head_dir(tmp_path, tensors={"w": torch.ones(2, 3)}), "test head")
    assert checkpoint.config == {"num_heads": 2} and checkpoint.weights.name == "model.safetensors"
    assert torch.equal(checkpoint.tensors["w"], torch.ones(2, 3))


@pytest.mark.parametrize(
    "config, weights, message",
    [
        (None, None, "test head directory .* does not exist"),
        ("{not json", b"", "test head config .*config.json is not valid JSON"),
        ("[1, 2]", b"", "must hold a JSON object"),
        ('{"a": 1}', None, r"has no weights file \(one of \['model.safetensors'\]\)"),
        ('{"a": 1}', b"truncated", "test head weights .*model.safetensors cannot be read"),
    ],
)
def test_a_bad_head_directory_is_one_line_naming_the_file(tmp_path, config, weights, message):
    directory = tmp_path / "head"
    if config is not None:
        directory.mkdir()
        (directory / "config.json").write_text(config)
        if weights is not None:
            (directory / "model.safetensors").write_bytes(weights)
    with pytest.raises((InputError, FileNotFoundError), match=message):
        read_checkpoint(directory, "test head")


def test_tensors_are_held_to_the_module(tmp_path):
    expected = {"a": torch.zeros(2), "b": torch.zeros(3)}
    check_tensors(tmp_path / "w", {"a": torch.ones(2), "b": torch.ones(3)}, expected, "head")
    with pytest.raises(InputError, match=r"miss \['b'\]"):
        check_tensors(tmp_path / "w", {"a": torch.ones(2)}, expected, "head")
    with pytest.raises(InputError, match=r"hold tensors this head has not: \['c'\]"):
        check_tensors(tmp_path / "w", {**expected, "c": torch.ones(1)}, expected, "head")
    with pytest.raises(InputError, match=r"b has shape \(4,\), expected \(3,\)"):
        check_tensors(tmp_path / "w", {"a": torch.ones(2), "b": torch.ones(4)}, expected, "head")


def test_a_head_of_another_target_is_refused_by_its_dimension(make_llama):
    target = make_llama(seed=0)  # hidden 32, 2 layers, vocabulary 128
    check_fits_target("head", target, hidden_size=32, num_layers=2, vocab_size=128)
    check_fits_target("head", target)  # nothing to compare
    for dimension, kwargs in (
        ("hidden size 48", {"hidden_size": 48}),
        ("number of layers 4", {"num_layers": 4}),
        ("vocabulary 64", {"vocab_size": 64}),
    ):
        with pytest.raises(InputError, match=f"head trained for a target of {dimension}, this target's is"):
            check_fits_target("head", target, **kwargs)
