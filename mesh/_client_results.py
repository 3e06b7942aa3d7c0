"""Waiting for a task's outcome: its kept result, or its dead letter (the
client's :meth:`~mesh.Client.result`).
"""

from __future__ import annotations

import math

import anyio
import outcome

from ._binding import payload_bytes
from ._blob import stored
from ._client_core import ClientCore
from ._errors import DeadLetterError, MeshError
from ._keys import check_queue
from ._pubsub import open_pubsub
from ._replies import parse_dead, parse_result
from ._types import DeadLetter
from ._validate import seconds

__all__ = ["ClientResults"]

# result(): the queue's awaiting key (finish publishes done messages only
# while it exists) lives this long and is refreshed this often while waiting
AWAITING_TTL_MS = 10_000
AWAITING_REFRESH = 1.0


class ClientResults(ClientCore):
    """Waiting for results (part of :class:`~mesh.Client`)."""

    async def result(
        self,
        queue: str,
        task: bytes | str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - waiting is the point of this call
    ) -> bytes | None:
        """Wait for the outcome of the latest finished instance of ``task`` on
        ``queue``, a queue whose policy keeps results (``result_ttl``, see
        :meth:`configure`), and return what its handler returned: bytes
        (a ``str`` was encoded as UTF-8), or None.

        It returns at once if the outcome is there already (kept for
        ``result_ttl`` seconds after the task finished). Otherwise it waits
        for the queue's done message and checks again, and also checks
        again after 50 ms, 100 ms, ... up to every second (a lost message
        costs at most a second); no polling loop is needed in your code.
        One pub/sub connection is opened for the wait, and while it waits
        the queue's ``awaiting`` key is kept (workers publish done messages
        only while someone awaits them; it expires 10 s after the last
        waiter left).

        Raises:
            DeadLetterError: the latest outcome is a dead letter (it failed
                its last allowed attempt); ``exc.dead_letter`` has its
                attempts, last error, last worker and time. A dead letter
                counts until it is requeued or purged.
            MeshError: the task finished while this call waited and no
                result was kept (the queue kept no results when it ran: a
                ``result_ttl`` set just before the enqueue may reach the
                workers after the task ran), so none will come.
            TimeoutError: no outcome within ``timeout`` seconds (None: wait
                for ever). On a queue without ``result_ttl`` nothing is kept,
                so only a dead letter or a finish seen while waiting ends
                the wait.
            TypeError, ValueError, ConfigError: a bad payload, queue name or
                timeout.
            MeshConnectionError: Redis could not be reached.

        On cancellation nothing is left behind (the pub/sub connection is
        closed).
        """
        conn = self._check()
        check_queue(queue)
        # a big payload's records hold its stand-in (mesh._blob)
        payload = stored(payload_bytes(task, self._max_payload, named=True))
        if timeout is not None:
            seconds("timeout", timeout)
        deadline = anyio.current_time() + (math.inf if timeout is None else timeout)
        got = await self._outcome(queue, payload)
        if got is not None:
            return got.unwrap()
        async with open_pubsub(
            conn.config, name=f"mesh-result:{self._keys.namespace}", route_key=self._keys.prefix
        ) as ps:
            # on the namespace's master (a cluster's SPUBLISH stays in its shard)
            await ps.subscribe(self._keys.done_channel(queue), sharded=True)
            # finish publishes done messages only while this key exists: set
            # after subscribing, refreshed while waiting, left to expire
            awaiting = self._keys.awaiting(queue)
            await conn.execute("SET", awaiting, b"", "PX", AWAITING_TTL_MS)
            marked = anyio.current_time()
            wait = 0.05
            while True:
                # checked after subscribing and marking: a finish before it
                # is seen here, one after it is published
                got = await self._outcome(queue, payload)
                if got is not None:
                    return got.unwrap()
                now = anyio.current_time()
                if now - marked >= AWAITING_REFRESH:
                    await conn.execute("SET", awaiting, b"", "PX", AWAITING_TTL_MS)
                    marked = now
                if now >= deadline:
                    raise TimeoutError(
                        f"no outcome of the task on queue {queue} within {timeout:g} s"
                    )
                finished = False
                with anyio.CancelScope(deadline=min(deadline, now + wait)):
                    async for msg in ps:
                        if msg.data == payload or msg.kind == "reconnected":
                            finished = msg.kind != "reconnected"
                            break
                wait = min(wait * 2, 1.0)
                if finished and await self._outcome(queue, payload) is None:
                    # finish keeps the result before it publishes: none is kept
                    raise MeshError(
                        f"the task finished on queue {queue} with no result kept (the "
                        "queue's policy kept no results when it ran); none will come"
                    )

    async def _outcome(self, queue: str, payload: bytes) -> outcome.Outcome[bytes | None] | None:
        """The latest outcome of ``payload``: its kept result or its latest
        dead letter, whichever is later; None if neither exists."""
        rec, dead = await self._reads.outcome(queue, payload)
        res = parse_result(rec, payload) if rec is not None else None
        last: DeadLetter | None = None
        for raw in dead:
            if raw.endswith(payload):
                d = parse_dead(raw, queue)
                if d.task == payload:
                    last = d
        if last is not None and (res is None or last.when >= res[0]):
            return outcome.Error(
                DeadLetterError(
                    f"the task was dead-lettered after {last.attempts} attempts: "
                    f"{last.error or 'failed'}",
                    last,
                )
            )
        if res is not None:
            return outcome.Value(res[1])
        return None
