"""Bad input from a user, and the validators that name it.

``InputError`` is the one error class for bad input (an argument, a config key, a file,
a command-line value); ``ConfigError`` is the config loader's kind of it. The ``check_*``
functions turn a value into the type it must have or raise one of them, naming the key.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


class InputError(ValueError):
    """Bad input from a user: an argument, a config key, a file or a command-line value.

    The message is one line that names the offending argument, key or file and says what
    is allowed. The command line prints it without a traceback (exit code 2); every other
    exception is a bug and keeps its traceback.
    """


class ConfigError(InputError):
    """A config that cannot be used as given; the message is one line naming the key or file."""


def check_real(name: str, value: Any) -> float:
    """``value`` as a float when it is a real number (int, float, numpy scalar; not bool); else an InputError naming ``name``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int beyond float range: let the range checks refuse it
            return math.inf if value > 0 else -math.inf
    raise InputError(f"{name} must be a real number (int or float), got {value!r} ({type(value).__name__})")


def check_probability(name: str, value: Any) -> float | None:
    """``value`` as a float in [0, 1), or None; else an InputError naming ``name`` (a threshold on draft probabilities)."""
    if value is None:
        return None
    if not 0.0 <= check_real(name, value) < 1.0:
        raise InputError(f"{name} must be in [0, 1) or None, got {value!r}")
    return float(value)


def check_integer(name: str, value: Any) -> int:
    """``value`` as an int when it is an integer (int, numpy integer; not bool, not float); else an InputError naming ``name``."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise InputError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
