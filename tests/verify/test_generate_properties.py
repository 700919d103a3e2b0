"""Property-based: ``generate`` with any argument values either decodes (greedy: token-identical to plain) or names the bad argument."""

from __future__ import annotations

import numpy as np
import torch
from bad_input import ANY_VALUE, assert_one_line_naming
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.ngram import NgramProposer
from draftsmith.verify import SpeculativeDecoder

PROMPT = torch.tensor([[1, 5, 9, 5, 9, 5, 9, 3]])
ARGUMENTS = ["max_new_tokens", "temperature", "top_k", "top_p", "seed", "eos_token_id"]
VALUES = st.one_of(
    ANY_VALUE,
    st.integers(min_value=-2, max_value=8),
    st.floats(min_value=-0.5, max_value=2.0),
    st.builds(np.int64, st.integers(min_value=-2, max_value=200)),
    st.builds(np.float32, st.floats(min_value=-1, max_value=2, width=32)),
    st.builds(torch.tensor, st.integers(min_value=-1, max_value=200)),
    st.builds(lambda xs: torch.tensor(xs), st.lists(st.integers(min_value=0, max_value=127), min_size=1, max_size=3)),
    st.builds(lambda x: torch.tensor([x]), st.floats(min_value=0, max_value=1)),
)


def test_generate_decodes_or_names_the_bad_argument(model):
    decoder = SpeculativeDecoder(model, NgramProposer(min_n=1), adaptive=False)
    plain = SpeculativeDecoder(model)

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(st.sampled_from(ARGUMENTS), VALUES, min_size=1, max_size=3))
    def check(kwargs):
        kwargs = {"max_new_tokens": 6, **kwargs}
        try:
            result = decoder.generate(PROMPT, **kwargs)
        except (InputError, FileNotFoundError) as err:
            assert_one_line_naming(err, *kwargs, "positions")
            return
        assert 1 <= len(result.new_tokens) <= int(kwargs["max_new_tokens"])
        if float(kwargs.get("temperature", 0.0)) == 0.0:
            assert result.new_tokens == plain.generate(PROMPT, **kwargs).new_tokens

    check()


def test_tiny_positive_temperatures_decode_like_greedy(model):
    # softmax(logits / T) tends to the argmax as T -> 0; at T = 6e-84 or 5e-324 plain
    # division overflowed to a NaN distribution and generate crashed.
    greedy = SpeculativeDecoder(model).generate(PROMPT, max_new_tokens=8).new_tokens
    decoder = SpeculativeDecoder(model, NgramProposer(min_n=1), adaptive=False)
    for temperature in (5e-324, 6.239321599771941e-84, 1e-30):
        assert decoder.generate(PROMPT, max_new_tokens=8, temperature=temperature, seed=0).new_tokens == greedy
