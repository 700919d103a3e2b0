"""Logits processing shared by target and drafts: temperature, top-k, top-p, greedy, masks."""

from __future__ import annotations

import pytest
import torch

from draftsmith.proposers.core.sampling import SamplingParams, logits_to_probs


def test_greedy_is_point_mass_on_argmax():
    probs = logits_to_probs(torch.tensor([[0.1, 3.0, -1.0]]), SamplingParams(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 0.5])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, -1))


@pytest.mark.parametrize("temperature", [5e-324, 6.2e-84, 1e-30, 1e-6])
@pytest.mark.parametrize("sampling", [{}, {"top_k": 2}, {"top_p": 0.5}])
def test_tiny_temperatures_tend_to_the_argmax_instead_of_overflowing(temperature, sampling):
    logits = torch.tensor([[0.1, 3.0, -1.0, float("-inf")], [2.0, 2.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature, **sampling))
    assert torch.isfinite(probs).all()
    # The limit of softmax(logits / T) as T -> 0: the argmax, ties shared.
    expected = [[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]
    if sampling.get("top_p") == 0.5:  # top-p keeps the first of two tied tokens: its mass reaches 0.5
        expected[1] = [1.0, 0.0, 0.0, 0.0]
    assert probs.tolist() == expected
    # Negative control: dividing the raw logits overflows to inf and a NaN softmax at the tiniest ones.
    naive = torch.softmax(logits / temperature, dim=-1)
    assert torch.isnan(naive).any() == (temperature < 1e-30)


def test_top_k_keeps_k_largest():
    probs = logits_to_probs(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingParams(temperature=1.0, top_k=2))
    assert (probs[[0, 3]] == 0).all() and probs.sum().item() == pytest.approx(1.0)
    torch.testing.assert_close(probs[[1, 2]], torch.softmax(torch.tensor([4.0, 3.0]), -1))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(kept, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # top_p below the largest probability keeps just the top token, never nothing
    assert logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.1)).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_partially_masked_logits_are_fine_fully_masked_are_an_error():
    logits = torch.tensor([float("-inf"), 0.0, float("-inf")])
    assert logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5)).tolist() == [0.0, 1.0, 0.0]
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match="masked"):
            logits_to_probs(torch.full((3,), float("-inf")), SamplingParams(temperature=temperature))


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.01}, {"top_k": -2}])
def test_invalid_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
