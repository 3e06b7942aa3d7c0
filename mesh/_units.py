"""Seconds as the scripts take them: whole milliseconds, within bounds.

Every duration or time a caller gives in seconds (a delay, a due time, a
retry backoff, a handler timeout, a result TTL, a schedule's period) becomes
milliseconds here and nowhere else, so one rule refuses what the scripts and
the readers of stored times could not handle: a value that is not finite, is
below its minimum, or above :data:`MAX_SECONDS` (ten years; ``1e308 * 1000``
is infinite and cannot be an int, and a due time beyond the year 9999 cannot
be shown as a date).
"""

from __future__ import annotations

import math

from ._errors import ConfigError

__all__ = ["MAX_SECONDS", "MAX_UNIX_TIME", "seconds_ms"]

#: The longest duration accepted anywhere: ten years (of 365 days), in seconds.
MAX_SECONDS = 10 * 365 * 24 * 3600

#: The latest time accepted as a due time (``enqueue(at=...)``):
#: 9999-12-31T23:59:59Z, the last second a :class:`datetime.datetime` holds.
MAX_UNIX_TIME = 253402300799


_NAMED: dict[float, str] = {
    MAX_SECONDS: " (10 years)",
    MAX_UNIX_TIME: " (9999-12-31T23:59:59Z)",
}


def seconds_ms(
    name: str, value: object, *, minimum: float = 0.0, maximum: float = MAX_SECONDS
) -> int:
    """``value`` seconds as whole milliseconds (rounded).

    Args:
        name: what the value is, for the error (``"backoff"``, ``"delay"``).
        minimum, maximum: the range allowed, in seconds, both included.

    Raises:
        TypeError: not a number (a bool is not one).
        ConfigError: not finite, or outside the range; the message names
            ``name``, the range, and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not (math.isfinite(value) and minimum <= value <= maximum):
        what = "a Unix time in seconds" if maximum == MAX_UNIX_TIME else "a number of seconds"
        raise ConfigError(
            f"{name} must be {what} from {minimum:g} to {maximum:,.0f}"
            f"{_NAMED.get(maximum, '')}, got {value!r}"
        )
    return round(value * 1000)
