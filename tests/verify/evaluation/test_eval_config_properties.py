"""Property-based: an eval config either validates or fails in one line naming the key; domain files likewise name the file."""

from __future__ import annotations

import dataclasses

import pytest
from bad_input import ANY_VALUE, ODD_KEYS, assert_one_line_naming
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftsmith.proposers.core.errors import InputError
from draftsmith.verify.evaluation.domains import load_domain
from draftsmith.verify.evaluation.evaluate import EvalConfig

KEYS = [f.name for f in dataclasses.fields(EvalConfig)]
PLAUSIBLE = st.one_of(
    st.integers(min_value=-2, max_value=300), st.floats(min_value=0, max_value=2), st.booleans(), st.none(), st.text(max_size=6)
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.dictionaries(st.one_of(st.sampled_from(KEYS), ODD_KEYS), st.one_of(PLAUSIBLE, ANY_VALUE), max_size=4))
def test_an_eval_config_validates_or_names_its_bad_key(extra):
    raw = {"target": "recipes/models/demo_target", "domains": {"code": "code.jsonl"}, **extra}
    try:
        config = EvalConfig.from_dict(raw)
    except InputError as err:
        assert_one_line_naming(err, *extra)
        return
    # accepted: every value has the type its field declares, within range
    assert isinstance(config.num_prompts, int) and not isinstance(config.num_prompts, bool) and config.num_prompts >= 1
    assert isinstance(config.temperature, float) and isinstance(config.peers, bool)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in config.domains.items()) and config.domains


ROWS = st.one_of(
    st.binary(max_size=64),  # anything on disk: binary, non-UTF-8, truncated
    st.builds(lambda s: s.encode(), st.text(max_size=40)),
    st.sampled_from(
        [b'{"prompt": 3}\n', b'{"messages": "hi"}\n', b'{"messages": [{"role": 1}]}\n', b"[1, 2]\n", b'{"prompt": "a", "messages": []}\n']
    ),
    st.builds(lambda t: (f'{{"prompt": "{t}"}}\n').encode(), st.text(alphabet="abc xyz", max_size=30)),
)


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_a_domain_file_gives_prompts_or_names_the_file(suffix, tiny_target_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    folder = tmp_path_factory.mktemp("domains")

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(ROWS, min_size=1, max_size=3))
    def check(chunks):
        path = folder / f"d{suffix}"
        path.write_bytes(b"".join(chunks))
        try:
            prompts = load_domain("d", path, tokenizer, num_prompts=4, prompt_tokens=16)
        except (InputError, FileNotFoundError) as err:
            assert_one_line_naming(err, str(path), path.name)
            return
        assert 1 <= len(prompts) <= 4 and all(p.input_ids.shape[1] <= 16 for p in prompts)

    check()


def test_one_huge_row_costs_no_more_than_a_normal_one(tiny_target_dir, tmp_path, monkeypatch):
    """A 24 MB prompt line used to be tokenized whole (4.2 GB of memory); only what the prompt needs is."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    seen = []
    encode = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, text, **kw: seen.append(len(text)) or encode(self, text, **kw))
    path = tmp_path / "huge.jsonl"
    path.write_text('{"prompt": "' + "the fox " * 3_000_000 + '"}\n')
    (prompt,) = load_domain("huge", path, tokenizer, num_prompts=1, prompt_tokens=32)
    assert prompt.input_ids.shape[1] == 32 and max(seen) <= 32 * 64
