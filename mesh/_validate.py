"""Checks of option values: a whole number in a range (never a bool, never
above :data:`MAX_COUNT`), a finite number of seconds (never above
:data:`~mesh._units.MAX_SECONDS`). Each raises one line that names the option, the
rule and the value given. The config classes use them as attrs validators
(:func:`whole_field`, :func:`seconds_field`); functions that take a loose
argument call :func:`whole` and :func:`seconds` directly.

The command line parses its numbers with these too (``mesh.cli._common``),
so a worker's option and ``mesh configure`` take the same values, and
refuse the others with the same message (exit status 2 there).

No I/O, and nothing here imports more than :mod:`mesh._errors` and
:mod:`mesh._units`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeGuard

from ._errors import ConfigError
from ._units import MAX_SECONDS

__all__ = [
    "MAX_COUNT",
    "is_number",
    "is_whole",
    "seconds",
    "seconds_field",
    "whole",
    "whole_field",
]


#: The largest whole number any option takes (a count of attempts, a rate
#: limit, a concurrency) unless it names a smaller bound: a billion, exact in
#: Lua's numbers and in JSON. Larger ones were stored as ``1e+20`` and logged
#: as "attempt 4 of 99999999999999991611392".
MAX_COUNT = 1_000_000_000


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
    """``value`` if it is a whole number from ``low`` to ``high`` (default
    :data:`MAX_COUNT`).

    Raises:
        ConfigError (or ``error``): anything else, bools included, e.g.
            ``batch must be a whole number >= 1, got 0``.
    """
    top = MAX_COUNT if high is None else high
    if is_whole(value) and low <= value <= top:
        return value
    too_big = is_whole(value) and value > top
    rule = f">= {low}" if high is None and not too_big else f"from {low:,} to {top:,}"
    raise error(f"{name} must be a whole number {rule}, got {value!r}")


def seconds(
    name: str,
    value: object,
    low: float = 0,
    *,
    high: float = MAX_SECONDS,
    wrong_type: type[Exception] = ConfigError,
) -> float:
    """``value`` if it is a finite number of seconds from ``low`` to ``high``
    (default: ten years, the bound of every duration; see :mod:`mesh._units`).

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
    if value > high:
        years = " (10 years)" if high == MAX_SECONDS else ""
        raise ConfigError(
            f"{name} must be a number of seconds from {low:g} to {high:,.0f}{years}, got {value!r}"
        )
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
