"""Replicated writes: ``WAIT`` until enough replicas acknowledged a connection's
writes (``min_replicas`` of workers, fleets and clients).

``WAIT`` runs on the connection itself (it counts the replicas that acknowledged
every write sent on that socket) and, when ``ASK`` redirections sent writes to
another node during a slot migration, on each such side connection
(:mod:`mesh._side`) too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel

from ._errors import CommandError, MeshConnectionError
from ._side import SideConnections

__all__ = ["wait_replicas"]


async def wait_replicas(
    execute: Callable[..., Awaitable[Any]],
    sides: SideConnections,
    where: str,
    count: int,
    seconds: float,
) -> None:
    """Wait until ``count`` replicas acknowledged every write sent so far with
    ``execute`` (a connection's :meth:`~mesh._connection.Connection.execute`,
    whose redacted URL is ``where``) and on its side connections ``sides``; a
    no-op for ``count`` 0.

    Raises:
        MeshConnectionError: fewer replicas acknowledged within ``seconds``
            seconds: the writes are on the master, and a failover may lose
            them; or the connection broke.

    On cancellation the ``WAIT`` still runs in Redis; nothing else happens.
    """
    if count <= 0:
        await anyio.lowlevel.checkpoint()
        return
    ms = max(1, int(seconds * 1000))
    acked = await execute("WAIT", count, ms)
    if acked < count:
        raise MeshConnectionError(
            f"only {acked} of {count} replicas of {where} acknowledged the "
            f"writes within {seconds:g}s: they are on the master, and a failover "
            "may lose them"
        )
    # Writes sent to a slot's importing node after ASK: WAIT there too.
    for node, side in sides.written():
        (acked,) = await sides.send(node, [("WAIT", count, ms)], asking=False)
        if isinstance(acked, CommandError):
            raise acked
        if acked < count:
            raise MeshConnectionError(
                f"only {acked} of {count} replicas of {node[0]}:{node[1]} (where "
                f"an ASK redirection sent writes) acknowledged them within "
                f"{seconds:g}s: a failover may lose them"
            )
        side.written = False
