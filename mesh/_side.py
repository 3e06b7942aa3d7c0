"""Side connections of a :class:`~mesh._connection.Connection`: to the nodes that
``ASK`` redirections name.

During a Redis Cluster slot migration, a command on a key the source node no longer
has is answered ``ASK slot host:port``: it must be sent once to that node, right
after ``ASKING``, while the connection itself stays on its node
(:mod:`mesh._redirect` decides that). :class:`SideConnections` keeps one plain
connection per such node, opened on first use and closed when the connection
reconnects or closes; they are rare (only during a migration), so each serves one
request at a time, with :func:`~mesh._transport.read_replies`, off the hot path.
It also remembers where writes went, for ``WAIT`` (:mod:`mesh._replicas`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from ._errors import ClosedError, MeshConnectionError
from ._loop import ByteStream, aclose_forcefully
from ._topology import Node, Topology
from ._transport import (
    CLOSED_ERRORS,
    TRANSPORT_ERRORS,
    Arg,
    connect,
    describe,
    pack,
    read_replies,
    scrub,
)
from ._url import RedisConfig

__all__ = ["Side", "SideConnections"]


class Side:
    """A connection to one node, one request at a time. ``written``: commands
    ran there since the last ``WAIT`` on it (:mod:`mesh._replicas` clears it)."""

    __slots__ = ("lock", "reader", "stream", "written")

    def __init__(self) -> None:
        self.lock = anyio.Lock()
        self.stream: ByteStream | None = None
        self.reader: Any = None
        self.written = False


class SideConnections:
    """The side connections of one connection, by node.

    Args:
        topology: where to find a node's connection settings
            (:meth:`~mesh._topology.Topology.node_config`).
        config: the connection's settings (``connect_timeout``, and what to
            scrub from errors).
        name: the client name (``CLIENT SETNAME``) of the connection.
        where: the connection's redacted URL, for errors.

    Attributes:
        asks: commands sent after ``ASKING`` so far.
        closed: the connection was closed: :meth:`send` raises
            :class:`~mesh.ClosedError`.
    """

    def __init__(
        self, topology: Topology, config: RedisConfig, name: str | None, where: str
    ) -> None:
        self._topology = topology
        self._config = config
        self._name = name
        self._where = where
        self._sides: dict[Node, Side] = {}
        self.asks = 0
        self.closed = False

    def written(self) -> list[tuple[Node, Side]]:
        """The side connections that ran commands sent after ``ASKING`` since
        the last ``WAIT`` on them (which clears their ``written``)."""
        return [(node, side) for node, side in self._sides.items() if side.written]

    async def send(
        self, node: Node, commands: Sequence[Sequence[Arg]], *, asking: bool = True
    ) -> list[Any]:
        """Send ``commands`` to ``node`` on its side connection (opened on first use),
        each after ``ASKING`` unless ``asking`` is false, and return their replies
        (error replies in place), all within ``connect_timeout``.

        Raises:
            MeshConnectionError: the node could not be reached or did not answer
                in time (then it is unknown whether the commands ran); the side
                connection is closed and opened again on the next use.
            ClosedError: the connection was closed.

        On cancellation the side connection is closed (its replies would be
        out of step); Redis may still run what was written.
        """
        if self.closed:
            raise ClosedError(f"the connection to {self._where} is closed")
        side = self._sides.get(node)
        if side is None:
            side = self._sides[node] = Side()
        data: list[bytes | memoryview] = []
        for command in commands:
            if asking:
                data.extend(pack(("ASKING",)))
            data.extend(pack(command))
        per = 2 if asking else 1
        async with side.lock:
            try:
                with anyio.fail_after(self._config.connect_timeout):
                    if side.stream is None:
                        config = self._topology.node_config(node)
                        side.stream, side.reader, _ = await connect(config, name=self._name)
                    if self.closed:
                        raise ClosedError(f"the connection to {self._where} is closed")
                    if asking:
                        side.written = True
                        self.asks += len(commands)
                    await side.stream.send_all(b"".join(data))
                    replies = await read_replies(side.stream, side.reader, per * len(commands))
            except BaseException as exc:
                stream, side.stream = side.stream, None
                if stream is not None:
                    await aclose_forcefully(stream)
                lost = self._lost(node, exc)
                if lost is None:
                    raise
                raise lost from (None if isinstance(exc, TimeoutError) else exc)
        return replies[per - 1 :: per]

    def _lost(self, node: Node, exc: BaseException) -> MeshConnectionError | None:
        """What :meth:`send` raises for a timeout or a transport failure ``exc``;
        None for anything else (raised as it is)."""
        where = f"{node[0]}:{node[1]}"
        if isinstance(exc, TimeoutError):
            return MeshConnectionError(
                f"{where} (the target of an ASK redirection) did not answer within "
                f"connect_timeout={self._config.connect_timeout:g}s (the command may "
                "or may not have run)"
            )
        if isinstance(exc, (*TRANSPORT_ERRORS, *CLOSED_ERRORS)):
            return MeshConnectionError(
                scrub(
                    f"lost {where} (the target of an ASK redirection; the command "
                    f"may or may not have run): {describe(exc)}",
                    self._config,
                )
            )
        return None

    async def aclose(self) -> None:
        """Close every side connection (a migration's are done with once the
        connection reconnects); the next :meth:`send` opens them again."""
        sides, self._sides = self._sides, {}
        for side in sides.values():
            if side.stream is not None:
                await aclose_forcefully(side.stream)
