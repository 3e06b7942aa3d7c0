"""The warning about diskless replication with a delay, for processes that
wait for replicas (``min_replicas >= 1``).

A master with ``repl-diskless-sync yes`` (Redis's default since 7.0) waits
``repl-diskless-sync-delay`` seconds (5 by default) before it streams a full
resync to a replica, hoping that more replicas will ask. After a planned
failover, a replica that was not promoted is often a few bytes ahead of the
new master and is refused a partial resync: until its full resync starts, no
replica acknowledges anything, and every write that waits for replicas
(``WAIT``) stalls for about that delay (5-7 s measured, see
docs/guarantees.md). Setting the delay to 0 makes the same failover take a
tenth of a second.

:func:`warn_diskless_delay` reads the master's settings once, at start, and
logs one WARNING naming the setting and its value. An ACL that refuses
``CONFIG`` (common on managed Redis) is not an error: nothing is said.
"""

from __future__ import annotations

import logging
from typing import Any

from ._connection import Connection
from ._errors import CommandError

__all__ = ["diskless_delay", "warn_diskless_delay"]

log = logging.getLogger("mesh.replicas")


def diskless_delay(reply: Any) -> int | None:
    """The delay in seconds (> 0) from the reply of ``CONFIG GET
    repl-diskless-sync*`` when the master syncs diskless with one, else
    None (disk-based sync, no delay, or a reply this does not understand).
    Sync, no I/O."""
    if isinstance(reply, dict):
        pairs = dict(reply)
    elif isinstance(reply, list) and len(reply) % 2 == 0:
        pairs = dict(zip(reply[::2], reply[1::2], strict=True))
    else:
        return None
    values = {_text(k): _text(v) for k, v in pairs.items()}
    if values.get("repl-diskless-sync") != "yes":
        return None
    try:
        delay = int(values.get("repl-diskless-sync-delay", "0"))
    except ValueError:
        return None
    return delay if delay > 0 else None


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


async def warn_diskless_delay(conn: Connection, min_replicas: int, who: str) -> None:
    """With ``min_replicas >= 1``, log one WARNING (logger ``mesh.replicas``)
    if the master of ``conn`` syncs replicas diskless with a delay, naming
    ``repl-diskless-sync-delay``, its value and what to set. ``who`` names
    the process (``"worker w1"``, ``"client"``).

    Raises:
        MeshConnectionError: Redis could not be reached. A refused ``CONFIG``
            (an ACL, a renamed command) is not an error: nothing is said.

    On cancellation nothing is left behind (one read).
    """
    if min_replicas < 1:
        return
    try:
        reply = await conn.execute("CONFIG", "GET", "repl-diskless-sync*")
    except CommandError:
        return
    delay = diskless_delay(reply)
    if delay is None:
        return
    log.warning(
        "%s with min_replicas=%d: the master %s syncs replicas diskless with "
        "repl-diskless-sync-delay %d (seconds): after a failover, writes that wait for "
        "replicas can stall about that long while a replica waits for its full resync; "
        "set repl-diskless-sync-delay 0 on every node (CONFIG SET and redis.conf; see "
        "docs/operating.md, 'Riding out a failover')",
        who,
        min_replicas,
        "at " + ":".join(map(str, conn.node)) if conn.node else "(unix socket)",
        delay,
    )
