"""The reconnect loop of the command and pub/sub connections.

:func:`reconnect` calls a connect attempt (the topology's, which finds the master
again) after each of :func:`~mesh._transport.backoff_delays` until one gets
through; a delay ends early when another connection of the same topology got
through (``Topology.reached``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from ._errors import MeshConnectionError
from ._transport import backoff_delays

__all__ = ["reconnect"]

T = TypeVar("T")


async def reconnect(
    attempt: Callable[[], Awaitable[T]],
    on_error: Callable[[str], None],
    hurry: Callable[[], anyio.Event] | None = None,
) -> T:
    """Call ``attempt`` after each backoff delay until it returns.

    Args:
        attempt: one connect attempt; a :class:`MeshConnectionError` means "try again".
        on_error: told each failed attempt's (password-free) message.
        hurry: gives an event that ends the current delay early when set: another
            connection to the same server got through (``Topology.reached``), so this
            one tries at once instead of sleeping out a backoff of up to a second.

    Returns:
        What ``attempt`` returned. It never gives up; cancel it to stop.
    """
    for delay in backoff_delays():
        if hurry is None:
            await anyio.sleep(delay)
        else:
            event = hurry()
            with anyio.move_on_after(delay):
                await event.wait()
        try:
            return await attempt()
        except MeshConnectionError as exc:
            on_error(str(exc))
    raise AssertionError("unreachable")  # pragma: no cover
