"""The redirect rules of :class:`~mesh._connection.Connection`, with no I/O.

Error replies that mean "this node did not run the command" (:data:`NOT_HERE`:
``MOVED``, ``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``, ``READONLY``, ``LOADING``,
``MASTERDOWN``) are not the caller's: the commands are sent again, in their order,
until every reply is a real one or the re-route budget (``reroute_timeout``) has
passed. What to do next is decided here, by :class:`Retry`, from the replies and a
time the caller passes in; the connection's I/O (:mod:`mesh._reroute`) only does it:

* ``ASK slot host:port`` (the key's slot is being migrated, the key is not on this
  node any more): each such command once to that node, after ``ASKING``
  (:class:`Ask`); the connection stays where it is. Inside ``MULTI``/``EXEC`` it is
  retried like ``TRYAGAIN``.
* ``TRYAGAIN`` (a multi-key command during a migration, its keys split between the
  two nodes): again on the same connection after a backoff from 5 ms doubling to
  200 ms (:class:`Resend` with a ``delay``).
* any other: re-route (ask the topology where the master is now, reconnect) and
  send again (:class:`Resend` with a ``reason``).

A pipeline holding a ``MULTI`` is sent again whole. Also here: how long the
reconnect after a re-route waits (:func:`reroute_pause`) and how often the
sentinels are asked who the master is (:func:`sentinel_poll_interval`).

The rules follow redis-py's cluster client (``redis/cluster.py``) and the Redis
Cluster specification.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import attrs

from ._errors import CommandError

__all__ = [
    "NOT_HERE",
    "STAY",
    "Ask",
    "Resend",
    "Retry",
    "ask_target",
    "is_transaction",
    "reroute_pause",
    "sentinel_poll_interval",
]

Node = tuple[str, int]

# Error replies that mean "this node did not run the command": re-route and retry.
NOT_HERE: Final = frozenset(
    {"MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "READONLY", "LOADING", "MASTERDOWN"}
)
# Of those, the ones that leave the connection on its node.
STAY: Final = frozenset({"ASK", "TRYAGAIN"})

# TRYAGAIN: the first wait before sending again in place, and the longest.
BACKOFF_START: Final = 0.005
BACKOFF_CAP: Final = 0.2
# Re-routes less than this many seconds apart count as one streak, whose
# reconnect waits double from 10 ms up to 0.5 s.
REROUTE_STREAK_GAP: Final = 2.0
REROUTE_PAUSE_START: Final = 0.01
REROUTE_PAUSE_CAP: Final = 0.5


def ask_target(error: CommandError, here: Node | None) -> Node | None:
    """The node of an ``ASK <slot> <host>:<port>`` reply (an empty or ``?`` host:
    the host of ``here``); None if the reply cannot be read."""
    words = str(error).split()
    if len(words) < 3 or words[0] != "ASK":
        return None
    host, _, port = words[2].rpartition(":")
    host = host.strip("[]")
    if host in ("", "?"):
        if here is None:
            return None
        host = here[0]
    try:
        return host, int(port)
    except ValueError:
        return None


def is_transaction(commands: Sequence[Sequence[object]]) -> bool:
    """Whether ``commands`` hold a ``MULTI`` (then they are sent again whole)."""
    return any(c and c[0] in ("MULTI", b"MULTI", "multi", b"multi") for c in commands)


def not_here(reply: object) -> bool:
    """Whether ``reply`` is an error reply meaning "not executed here"."""
    return type(reply) is CommandError and reply.code in NOT_HERE


def reroute_pause(streak: int, last: float, now: float) -> tuple[int, float]:
    """The streak and the wait before reconnecting after a re-route at ``now``,
    the previous one at ``last`` with ``streak``: a re-route within
    :data:`REROUTE_STREAK_GAP` seconds of the previous one continues its streak,
    and each one in a streak waits twice as long (10 ms, 20 ms... up to 0.5 s)."""
    streak = 0 if now - last > REROUTE_STREAK_GAP else streak + 1
    return streak, min(REROUTE_PAUSE_START * 2**streak, REROUTE_PAUSE_CAP)


def sentinel_poll_interval(reroute_timeout: float) -> float:
    """How often a connection on Sentinel asks the sentinels who the master is: a
    quarter of the re-route budget, between 50 ms and 1 s."""
    return min(1.0, max(0.05, reroute_timeout / 4))


@attrs.frozen
class Ask:
    """Send each listed command once to its node, after ``ASKING``; then ask
    :meth:`Retry.step` again.

    Attributes:
        by_node: the indices of the commands to send, by the node named in their
            ``ASK`` reply, in their order.
        first: the first "not executed here" reply (for the error if the budget
            runs out while the commands are in flight).
    """

    by_node: dict[Node, list[int]]
    first: CommandError | None


@attrs.frozen
class Resend:
    """Send the commands at ``indices`` again on the connection, back to back.

    Attributes:
        indices: which commands, in order.
        delay: ``TRYAGAIN``: wait this long first and stay on the node; None:
            re-route first (see ``reason``).
        reason: why the connection re-routes (the first "not executed here"
            reply, or ``"retry"``).
        first: the first reply that asked for this (None: not an error reply,
            as a ``MULTI``'s ``OK``), for the error if the budget runs out while
            the commands are in flight.
    """

    indices: list[int]
    delay: float | None
    reason: str
    first: CommandError | None


class Retry:
    """The replies of one call while its "not executed here" commands are sent
    again: feed it what came back (:meth:`record`), ask it what to do next
    (:meth:`step`). No I/O, no clock but the times passed in.

    Args:
        commands: the call's commands.
        replies: their first replies, some of them "not executed here".
        now: the current time (the budget starts here).
        budget: ``reroute_timeout`` in seconds.
        here: the node of the connection (for an ``ASK`` naming no host).
    """

    def __init__(
        self,
        commands: Sequence[Sequence[object]],
        replies: Sequence[Any],
        *,
        now: float,
        budget: float,
        here: Node | None,
    ) -> None:
        self.replies = list(replies)
        self.budget = budget
        self.deadline = now + budget
        self.transaction = is_transaction(commands)
        self.here = here
        self.backoff = BACKOFF_START

    def todo(self) -> list[int]:
        """The indices of the commands to send again (all of a transaction's
        while any of its replies says "not executed here")."""
        replies = self.replies
        todo = [i for i, r in enumerate(replies) if not_here(r)]
        if todo and self.transaction:
            return list(range(len(replies)))
        return todo

    def record(self, indices: Sequence[int], replies: Sequence[Any]) -> None:
        """The replies of the commands at ``indices``, sent again."""
        for i, r in zip(indices, replies, strict=True):
            self.replies[i] = r

    def step(self, now: float) -> Ask | Resend | None:
        """What to do next at time ``now``; None: :attr:`replies` are final (every
        reply a real one, or the budget has run out: then the "not executed here"
        errors stay in place, each with a note saying so).

        Raises:
            CommandError: an ``ASK`` reply whose node cannot be read (that reply).
        """
        todo = self.todo()
        if not todo:
            return None
        replies = self.replies
        first = replies[todo[0]] if type(replies[todo[0]]) is CommandError else None
        if now >= self.deadline:
            for i in todo:
                r = replies[i]
                if type(r) is CommandError:
                    r.add_note(
                        f"(not executed here; still so after re-routing for "
                        f"reroute_timeout={self.budget:g}s)"
                    )
            return None
        if not self.transaction:
            by_node: dict[Node, list[int]] = {}
            for i in todo:
                if replies[i].code == "ASK":
                    node = ask_target(replies[i], self.here)
                    if node is None:
                        raise replies[i]
                    by_node.setdefault(node, []).append(i)
            if by_node:
                # The keys' slot is migrating: each command once to its node.
                return Ask(by_node, first)
        codes = {r.code for r in replies if not_here(r)}
        if codes <= STAY:
            delay = self.backoff
            self.backoff = min(self.backoff * 2, BACKOFF_CAP)
            return Resend(todo, delay, "", first)
        return Resend(todo, None, str(first) if first is not None else "retry", first)
