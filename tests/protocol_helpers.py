"""Helpers for tests that drive the Lua scripts directly."""

from __future__ import annotations

from typing import Any

from mesh._binding import Binding
from mesh._connection import Connection
from mesh._keys import Keys


async def expire_worker(conn: Connection, keys: Keys, worker: str) -> None:
    """Make a worker's lease run out now (forced, not slept): the heartbeat
    key is deleted and its deadline moved into the past, as after a real
    expiry."""
    await conn.pipeline([("DEL", keys.heartbeat(worker)), ("ZADD", keys.workers, 0, worker)])


async def join(
    b: Binding, conn: Connection, worker: str, *queues: str, ttl_ms: int = 60_000
) -> str:
    """Register ``worker`` and serve ``queues``; return its incarnation."""
    inc = "inc-" + worker
    await b.register(conn, worker, inc, ttl_ms, b"{}")
    for q in queues:
        await b.serve(conn, worker, inc, q)
    return inc


async def snapshot(conn: Connection, keys: Keys, queue: str, workers: list[str]) -> dict[str, Any]:
    """Everything the protocol keeps about one queue and some workers."""
    r = await conn.pipeline(
        [
            ("LRANGE", keys.queue(queue), 0, -1),
            ("HGETALL", keys.persistent(queue)),
            ("HGETALL", keys.procs(queue)),
            ("HGETALL", keys.attempts(queue)),
            ("ZRANGE", keys.delayed(queue), 0, -1),
            ("LRANGE", keys.dead(queue), 0, -1),
            ("SMEMBERS", keys.standby(queue)),
        ]
        + [("SMEMBERS", keys.held(w, queue)) for w in workers]
        + [("SMEMBERS", keys.inbox(w)) for w in workers]
    )

    def pairs(flat: list[bytes]) -> dict[bytes, bytes]:
        return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}

    n = len(workers)
    # A queued persistent task is a member of the standby set or a field of
    # the persistent hash with the value "" (include/to_standby.lua picks by
    # memory): "standby" is both, "persistent" only the running ones.
    pers, in_set = pairs(r[1]), set(r[6])
    assert not in_set & set(pers), f"in the standby set and the hash: {in_set & set(pers)}"
    return {
        "queue": list(r[0]),
        "persistent": {p: v for p, v in pers.items() if v},
        "procs": pairs(r[2]),
        "attempts": pairs(r[3]),
        "delayed": list(r[4]),
        # dead-letter records (include/dead_record.lua): the payload is last
        "dead": [rec.split(b"\0", 5)[-1] for rec in r[5]],
        "standby": in_set | {p for p, v in pers.items() if not v},
        "held": {w: {x.decode() for x in r[7 + i]} for i, w in enumerate(workers)},
        "inbox": {w: {x.decode() for x in r[7 + n + i]} for i, w in enumerate(workers)},
    }
