"""What the sentinels announce while they fail a master over, for the topology.

A planned failover (``SENTINEL FAILOVER``, managed Redis maintenance) leaves the old
master up and taking writes for seconds after a replica was promoted: Sentinel
demotes it only once it has noticed the new configuration (about 8 s on loopback).
Every write that lands there in between is lost when it resyncs as a replica, and
so are writes acknowledged by ``WAIT`` on another replica that is then re-pointed.
Polling ``SENTINEL GET-MASTER-ADDR-BY-NAME`` does not help: the sentinel that runs
the failover names the new master only at its very end (measured: 1.7 s after the
promotion), the others a little earlier.

The sentinels announce each step on their pub/sub channels, on every sentinel (the
one that runs the failover announces its steps; the others learn the outcome):

* ``+odown`` and ``+try-failover``: the master is failing over (writes are held);
* ``+selected-slave``: the replica chosen; ``+promoted-slave``: it was promoted
  and the failover will end with a switch to it (before that, an abort can turn
  it back into a replica, and every write it took would be lost);
* ``+switch-master``: done, with the old and the new address;
* ``-failover-abort-*``, ``-odown`` (before a replica was chosen): nothing moves.

:class:`FailoverWatch` keeps what was announced, as plain state fed by
:meth:`FailoverWatch.feed` (no I/O: a unit test drives it with messages and a
clock), and :meth:`FailoverWatch.run` subscribes on every sentinel to feed it. The
topology reads it: while a failover is in progress (for at most ``hold`` seconds
from its start), no connection is made to the old master; the replica is
used as soon as the sentinels announce its promotion; after the switch, a sentinel still naming
the old master is not believed. The command connection re-routes (holds its
writes, lets the owed replies arrive, reconnects) as soon as a failover of its
node is announced.

Errors: :meth:`run` never raises for a sentinel that is down or refuses; it tries
again with backoff. Cancellation closes every sentinel connection.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Final

import anyio
import attrs

from ._errors import MeshConnectionError
from ._loop import ByteStream, aclose_forcefully
from ._transport import TRANSPORT_ERRORS, backoff_delays, connect, next_reply
from ._url import RedisConfig

__all__ = ["FailoverWatch"]

log = logging.getLogger("mesh.connection")

Node = tuple[str, int]

#: The channels the watch subscribes to on each sentinel, and the pattern of
#: the aborts (their names vary by reason and version).
CHANNELS: Final = (
    "+odown",
    "-odown",
    "+try-failover",
    "+selected-slave",
    "+promoted-slave",
    "+switch-master",
    "+failover-end",
)
ABORTS: Final = "-failover-abort-*"


def _node(host: bytes | str, port: bytes | str) -> Node | None:
    try:
        return (host.decode() if isinstance(host, bytes) else host), int(port)
    except ValueError:
        return None


@attrs.define
class _State:
    """One failover's announcements (trio clock)."""

    started: float | None = None  # when the current failover began; None: none
    old: Node | None = None  # the master being failed over
    candidate: Node | None = None  # the replica chosen to become master
    # The replica Sentinel saw promoted: from here the failover does not go
    # back (an abort before it can leave a replica promoted and then turned
    # back into a replica, with every write it took lost).
    promoted: Node | None = None


class FailoverWatch:
    """The failover announcements of the sentinels for one service.

    Args:
        service: the master name the sentinels monitor.
        hold: for how long (seconds) from the start of a failover connections
            keep off the old master, waiting for the replica to be promoted;
            past it, the sentinels' answer is taken as it is.
    """

    def __init__(self, service: str, hold: float) -> None:
        self.service = service
        self.hold = hold
        self._state = _State()
        # The last switch announced: (old, new).
        self.switched: tuple[Node, Node] | None = None
        self._changed = anyio.Event()
        self.running = False
        self.messages = 0

    # ------------------------------------------------------------ state (no I/O)

    def feed(self, channel: bytes | str, data: bytes | str, now: float) -> bool:
        """Take one announcement; returns whether it concerned this service."""
        if isinstance(channel, bytes):
            channel = channel.decode(errors="replace")
        if isinstance(data, bytes):
            data = data.decode(errors="replace")
        words = data.split()
        s = self._state
        if channel == "+switch-master":
            # <name> <old ip> <old port> <new ip> <new port>
            if len(words) < 5 or words[0] != self.service:
                return False
            old, new = _node(words[1], words[2]), _node(words[3], words[4])
            if old is None or new is None:
                return False
            self.switched = (old, new)
            self._state = _State()
        elif channel in ("+selected-slave", "+promoted-slave"):
            # slave <ip:port> <ip> <port> @ <name> <master ip> <master port>
            if len(words) < 8 or words[4] != "@" or words[5] != self.service:
                return False
            node = _node(words[2], words[3])
            if node is None:
                return False
            if s.started is None:
                s.started = now
            s.old = _node(words[6], words[7])
            s.candidate = node
            if channel == "+promoted-slave":
                s.promoted = node
        else:
            # master <name> <ip> <port> ...
            if len(words) < 4 or words[0] != "master" or words[1] != self.service:
                return False
            node = _node(words[2], words[3])
            if channel in ("+odown", "+try-failover"):
                if s.started is None or s.old != node:
                    self._state = _State(started=now, old=node)
            elif channel == "-odown":
                if s.candidate is None:
                    self._state = _State()
            elif channel == "+failover-end" or channel.startswith("-failover-abort"):
                self._state = _State()
            else:
                return False
        self._changed.set()
        self._changed = anyio.Event()
        return True

    def in_progress(self, now: float) -> bool:
        """Whether a failover was announced and is not over, within ``hold``."""
        started = self._state.started
        return started is not None and now < started + self.hold

    def hold_until(self) -> float:
        """When the hold of the failover in progress ends (inf: none)."""
        started = self._state.started
        return math.inf if started is None else started + self.hold

    @property
    def old(self) -> Node | None:
        """The master being failed over (None: no failover in progress)."""
        return self._state.old

    @property
    def candidate(self) -> Node | None:
        """The replica chosen to become master, once announced."""
        return self._state.candidate

    @property
    def promoted(self) -> Node | None:
        """The replica Sentinel saw promoted (``+promoted-slave``), once
        announced: the point after which the failover ends with a switch to
        it, even if the rest times out."""
        return self._state.promoted

    def leaving(self, node: Node, now: float) -> bool:
        """Whether ``node`` is being failed over or was switched away from
        (and not switched back to since): a connection there must move."""
        if self.in_progress(now) and self._state.old == node:
            return True
        return self.switched is not None and self.switched[0] == node

    def replaced(self, node: Node) -> Node | None:
        """The new master if the last switch announced left ``node``."""
        if self.switched is not None and self.switched[0] == node:
            return self.switched[1]
        return None

    def forget_switch(self) -> None:
        """The switch target turned out not to be a master (a later failover
        that was missed): trust the sentinels' answers again."""
        self.switched = None

    async def wait_changed(self) -> None:
        """Return at the next announcement for this service. Cancellable."""
        await self._changed.wait()

    # ------------------------------------------------------------ I/O

    async def run(self, sentinels: Sequence[RedisConfig]) -> None:
        """Subscribe on every sentinel (one connection each) and feed what they
        announce, reconnecting with backoff when one fails, until cancelled."""
        self.running = True
        try:
            async with anyio.create_task_group() as nursery:
                for config in sentinels:
                    nursery.start_soon(self._listen, config)
        finally:
            self.running = False

    async def _listen(self, config: RedisConfig) -> None:
        delays = backoff_delays()
        while True:
            stream: ByteStream | None = None
            try:
                stream, reader, _ = await connect(
                    config, extra=[("SUBSCRIBE", *CHANNELS), ("PSUBSCRIBE", ABORTS)]
                )
                delays = backoff_delays()
                while True:
                    reply: Any = await next_reply(stream, reader)
                    if isinstance(reply, list) and reply:
                        kind = reply[0]
                        if kind == b"message" and len(reply) == 3:
                            self.messages += 1
                            self.feed(reply[1], reply[2], anyio.current_time())
                        elif kind == b"pmessage" and len(reply) == 4:
                            self.messages += 1
                            self.feed(reply[2], reply[3], anyio.current_time())
            except (MeshConnectionError, *TRANSPORT_ERRORS) as exc:
                log.debug("sentinel watch on %s: %s", config.redacted(), exc)
            finally:
                if stream is not None:
                    await aclose_forcefully(stream)
            await anyio.sleep(next(delays))
