"""generate()'s arguments: every bad value is one InputError line naming the argument; every accepted form works.

The accepted forms follow transformers' ``generate``: numpy scalars for numbers, and for
``eos_token_id`` an int, a numpy integer, a list / tuple or a 0-d / 1-D integer tensor.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.verify import SpeculativeDecoder

PROMPT = torch.tensor([[5, 9, 17, 33, 5, 9, 17, 60]])
MAX_NEW = 12


@pytest.fixture(scope="module")
def decoder(model):
    return SpeculativeDecoder(model, load_proposer({"type": "ngram", "min_n": 1}), adaptive=False)


@pytest.fixture(scope="module")
def reference(model):
    out = model.generate(PROMPT, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, PROMPT.shape[1] :].tolist()


def assert_one_line_naming(error: pytest.ExceptionInfo, name: str) -> None:
    message = str(error.value)
    assert error.type is InputError and name in message and "\n" not in message, message


BAD_NUMBERS = {
    "temperature": [math.inf, -math.inf, math.nan, -0.5, "0.7", True, None, torch.tensor(0.7), 10**400],
    "top_p": [0.0, 1.5, math.nan, math.inf, "0.9", True, None],
    "top_k": [-1, 2.5, 2.0, True, "3", None, np.float64(3.0)],
    "max_new_tokens": [0, -3, 2.5, 8.0, True, "8", None],
    "seed": [1.5, "1", True, 2**64, -(2**63) - 1],
}


@pytest.mark.parametrize(
    "name,value", [(name, value) for name, values in BAD_NUMBERS.items() for value in values], ids=lambda v: repr(v)[:24]
)
def test_bad_numbers_are_refused_up_front(name, value, decoder):
    with pytest.raises(ValueError) as error:
        decoder.generate(PROMPT, **{"max_new_tokens": 4, name: value})
    assert_one_line_naming(error, name)


@pytest.mark.parametrize("name", ["temperature", "top_p", "top_k"])
def test_sampling_params_refuse_the_same_values(name):
    for value in BAD_NUMBERS[name]:
        with pytest.raises(ValueError) as error:
            SamplingParams(**{name: value})
        assert_one_line_naming(error, name)


def test_numpy_scalars_are_accepted_and_stored_as_python_numbers(decoder):
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.5))
    assert (params.temperature, params.top_k, params.top_p) == (0.5, 3, 0.5)
    assert type(params.temperature) is float and type(params.top_k) is int and type(params.top_p) is float
    assert SamplingParams(temperature=1).temperature == 1.0
    plain = dict(max_new_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    numpy = dict(max_new_tokens=np.int32(6), temperature=np.float64(0.8), top_k=np.int16(20), top_p=np.float64(0.9), seed=np.int64(3))
    assert decoder.generate(PROMPT, **numpy).new_tokens == decoder.generate(PROMPT, **plain).new_tokens


BAD_PROMPTS = {
    "list": [[5, 9, 17]],
    "1-D": torch.tensor([5, 9, 17]),
    "batch of 2": torch.tensor([[5, 9], [17, 33]]),
    "float": torch.tensor([[5.0, 9.0]]),
    "bool": torch.tensor([[True, False]]),
    "empty": torch.zeros(1, 0, dtype=torch.long),
    "outside the vocabulary": torch.tensor([[5, 999]]),
    "negative": torch.tensor([[5, -1]]),
}


@pytest.mark.parametrize("kind", list(BAD_PROMPTS))
def test_bad_prompts_are_refused(kind, decoder):
    with pytest.raises(ValueError) as error:
        decoder.generate(BAD_PROMPTS[kind], max_new_tokens=4)
    assert_one_line_naming(error, "input_ids")
    if kind in ("outside the vocabulary", "negative"):
        assert "position 1" in str(error.value) and "[0, 128)" in str(error.value)


def test_integer_prompts_of_any_width_are_accepted(decoder, reference):
    for dtype in (torch.int32, torch.int16):
        assert decoder.generate(PROMPT.to(dtype), max_new_tokens=MAX_NEW).new_tokens == reference


# ---------------------------------------------------------------------------------------
# eos_token_id

EOS_FORMS = {
    "int": lambda eos: eos,
    "numpy integer": lambda eos: np.int64(eos),
    "0-d tensor": lambda eos: torch.tensor(eos),
    "1-D tensor": lambda eos: torch.tensor([eos]),
    "1-D tensor of two": lambda eos: torch.tensor([127, eos], dtype=torch.int32),
    "list": lambda eos: [eos],
    "tuple with a numpy integer": lambda eos: (127, np.int32(eos)),
}


@pytest.mark.parametrize("form", list(EOS_FORMS))
def test_every_eos_form_ends_generation_where_an_int_does(form, decoder, reference):
    eos = reference[5]
    assert 127 not in reference[: reference.index(eos)]  # the second id of the two-id forms is never hit first
    result = decoder.generate(PROMPT, max_new_tokens=MAX_NEW, eos_token_id=EOS_FORMS[form](eos))
    assert result.new_tokens == reference[: reference.index(eos) + 1]


BAD_EOS = {
    "float": 2.0,
    "bool": True,
    "string": "</s>",
    "list with a string": [2, "</s>"],
    "list with a float": [2.5],
    "nested list": [[2]],
    "float tensor": torch.tensor([2.0]),
    "2-D tensor": torch.tensor([[2]]),
    "outside the vocabulary": 500,
    "negative": -1,
    "list outside the vocabulary": [2, 128],
}


@pytest.mark.parametrize("kind", list(BAD_EOS))
def test_bad_eos_is_refused(kind, decoder):
    with pytest.raises(ValueError) as error:
        decoder.generate(PROMPT, max_new_tokens=4, eos_token_id=BAD_EOS[kind])
    assert_one_line_naming(error, "eos_token_id")
