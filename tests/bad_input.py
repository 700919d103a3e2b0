"""What the property-based tests of bad input share: value strategies and the one-line error contract.

Every interface (Python API, config files, CLI, files) must either accept an input and
work, or refuse it with the project's own ``InputError`` (or ``FileNotFoundError`` for a
missing path) whose message is one line naming the offending argument, key or file.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from draftsmith.proposers.core.errors import InputError

# Anything a YAML file, a command line or a careless caller may hand over.
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**9), max_value=10**9),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["no", "yes", "1e-3", "eight", "", "inf", "-1", "2.5", "[1, 2]"]),
    st.lists(st.integers(min_value=-3, max_value=300), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
# Keys that are not valid anywhere, next to near misses of valid ones.
ODD_KEYS = st.one_of(st.text(min_size=1, max_size=12), st.sampled_from(["kk", "Type", "model_path", "num-prompts", "lr", " k"]))


def assert_one_line_naming(error: BaseException, *names: str) -> None:
    """``error`` is the project's bad-input error, one line, naming one of ``names``."""
    assert isinstance(error, (InputError, FileNotFoundError)), f"{type(error).__name__}: {error}"
    message = str(error)
    assert message and "\n" not in message, repr(message)
    # names appear as given, or escaped as repr() writes them inside a quoted list
    assert any(str(name) in message or repr(str(name))[1:-1] in message for name in names), f"{message!r} names none of {names}"


def yaml_text(value) -> str:
    """``value`` as the text of a ``key=value`` override (what a user would type)."""
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    if isinstance(value, str):
        return value
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
