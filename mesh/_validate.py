"""Checks of option values: a whole number in a range (never a bool), a
finite number of seconds. Each raises one line that names the option, the
rule and the value given. The config classes use them as attrs validators
(:func:`whole_field`, :func:`seconds_field`); functions that take a loose
argument call :func:`whole` and :func:`seconds` directly.

No I/O, and nothing here imports more than :mod:`mesh._errors`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeGuard

from ._errors import ConfigError

__all__ = [
    "is_number",
    "is_whole",
    "seconds",
    "seconds_field",
    "whole",
    "whole_field",
]


def is_whole(value: object) -> TypeGuard[int]:
    """True for an int that is not a bool (``True`` is an int to Python, but
    never a count, a size or a limit to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """True for an int or a float that is not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def whole(
    name: str,
    value: object,
    low: int = 0,
    high: int | None = None,
    *,
    error: type[Exception] = ConfigError,
) -> int:
    """``value`` if it is a whole number from ``low`` (to ``high``, if given).

    Raises:
        ConfigError (or ``error``): anything else, bools included, e.g.
            ``batch must be a whole number >= 1, got 0``.
    """
    if is_whole(value) and value >= low and (high is None or value <= high):
        return value
    rule = f">= {low}" if high is None else f"from {low:,} to {high:,}"
    raise error(f"{name} must be a whole number {rule}, got {value!r}")


def seconds(
    name: str,
    value: object,
    low: float = 0,
    *,
    wrong_type: type[Exception] = ConfigError,
) -> float:
    """``value`` if it is a finite number of seconds >= ``low``.

    Raises:
        ConfigError: a number out of range, a NaN or an infinity, e.g.
            ``timeout must be a finite number of seconds >= 0, got inf``.
        ConfigError (or ``wrong_type``): not a number (a bool is not one).
    """
    if not is_number(value):
        if wrong_type is ConfigError:
            raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
        raise wrong_type(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value < low:
        raise ConfigError(f"{name} must be a finite number of seconds >= {low:g}, got {value!r}")
    return value


Validator = Callable[[Any, Any, Any], None]


def whole_field(
    low: int = 0, high: int | None = None, *, error: type[Exception] = ConfigError
) -> Validator:
    """An attrs validator: the field is a :func:`whole` number from ``low``
    (to ``high``); the message names the field."""

    def check(_instance: object, attribute: Any, value: object) -> None:
        whole(attribute.name, value, low, high, error=error)

    return check


def seconds_field(low: float = 0) -> Validator:
    """An attrs validator: the field is a finite number of :func:`seconds`
    >= ``low``; the message names the field."""

    def check(_instance: object, attribute: Any, value: object) -> None:
        seconds(attribute.name, value, low)

    return check
