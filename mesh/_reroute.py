"""The I/O of re-routing for :class:`~mesh._connection.Connection`: when to look
for the master again, and sending again what "not executed here" replies refused.

* :class:`Redirects` does what :class:`~mesh._redirect.Retry` decides for one
  call: ``ASK`` on a side connection (:mod:`mesh._side`), ``TRYAGAIN`` in place
  after the backoff, anything else after the connection re-routed, all within
  ``reroute_timeout``.
* :func:`follow_master` asks the connection to re-route when the master changed
  without any reply saying so: the pub/sub connection sharing the topology found a
  new one, or, on Sentinel, the sentinels name another one or announce a failover
  of ours (:mod:`mesh._failover`).

The connection itself only knows how to re-route when asked (stop writing, let the
owed replies arrive, reconnect to where the topology says); this module never
touches its sockets.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from ._errors import MeshConnectionError
from ._redirect import Ask, Resend, Retry, sentinel_poll_interval
from ._side import SideConnections
from ._topology import Node, Topology
from ._transport import Arg
from ._url import RedisConfig

__all__ = ["Redirects", "follow_master"]

Send = Callable[[Sequence[Sequence[Arg]]], Awaitable[list[Any]]]


class Redirects:
    """Sends again, for one connection, the commands its replies said were not
    executed there.

    Args:
        send: send commands back to back once on the connection and return their
            replies, errors in place (waits for a reconnect in progress).
        reroute: ask the connection to re-route, with the reason.
        sides: the connection's side connections, for ``ASK``.
        where: the connection's redacted URL, for errors.
        budget: ``reroute_timeout`` in seconds.

    Attributes:
        retries: commands sent again in place after ``TRYAGAIN``.
    """

    def __init__(
        self,
        send: Send,
        reroute: Callable[[str], None],
        sides: SideConnections,
        where: str,
        budget: float,
    ) -> None:
        self._send = send
        self._reroute = reroute
        self._sides = sides
        self._where = where
        self._budget = budget
        self.retries = 0

    async def resend(
        self, commands: Sequence[Sequence[Arg]], replies: list[Any], here: Node | None
    ) -> list[Any]:
        """Some of ``replies`` (to ``commands``, sent on the connection to node
        ``here``) say "not executed here": send those commands again as
        :class:`~mesh._redirect.Retry` decides, until every reply is a real one or
        ``reroute_timeout`` has passed since the first.

        Returns:
            ``replies`` with the retried ones replaced; after the budget, the last
            "not executed here" errors stay in place (as plain CommandErrors).

        Raises:
            CommandError: an ``ASK`` reply naming no readable node.
            MeshConnectionError: the connection broke, or the budget ran out while a
                retried command was in flight (it may or may not have run).
            ClosedError: the connection was closed.
        """
        now = anyio.current_time()
        retry = Retry(commands, replies, now=now, budget=self._budget, here=here)
        while (step := retry.step(anyio.current_time())) is not None:
            with anyio.move_on_after(max(0.0, retry.deadline - anyio.current_time())) as budget:
                if type(step) is Ask:
                    # A TRYAGAIN from there means: start over here, a little later.
                    for node, indices in step.by_node.items():
                        again = await self._sides.send(node, [commands[i] for i in indices])
                        retry.record(indices, again)
                else:
                    assert type(step) is Resend
                    if step.delay is not None:
                        await anyio.sleep(step.delay)
                        self.retries += len(step.indices)
                    else:
                        self._reroute(step.reason)
                    again = await self._send([commands[i] for i in step.indices])
                    retry.record(step.indices, again)
            if budget.cancelled_caught:
                raise MeshConnectionError(
                    f"{self._where}: a command answered {step.first} was re-sent after "
                    f"re-routing, and no reply came within reroute_timeout="
                    f"{self._budget:g}s (it may or may not have run)"
                )
        return retry.replies


async def follow_master(
    topology: Topology,
    config: RedisConfig,
    node: Node | None,
    reroute_timeout: float,
    reroute: Callable[[str], None],
) -> None:
    """Call ``reroute`` (once) when the pub/sub connection sharing ``topology``
    found a new master or, on Sentinel, when the sentinels name another master
    than ``node`` (the old one may stay reachable, and take writes, for seconds),
    polled every :func:`~mesh._redirect.sentinel_poll_interval`, or as soon as the
    sentinels announce a failover of ``node`` on pub/sub (:mod:`mesh._failover`):
    the re-route holds the writes, and the reconnect waits for the chosen
    replica's promotion. Never returns on a unix socket (``node`` None).

    The connection cancels it when it re-routes or its socket breaks.
    """
    if node is None or config.path is not None:
        await anyio.sleep_forever()
    assert node is not None
    reroute(await topology.wait_left(node, sentinel_poll_interval(reroute_timeout)))
