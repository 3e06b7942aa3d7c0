"""Redis pub/sub on its own trio-native connection, resubscribing after reconnects.

A :class:`PubSub` keeps the set of channels and patterns you asked for. When its
connection breaks (EOF, reset, ``CLIENT KILL``, or no reply to a ``PING`` within
twice ``ping_interval``: a dead or half-open socket), it reconnects with backoff,
subscribes to all of them again and then yields ``Message(kind="reconnected")``:
messages published while it was away are lost, so the consumer must re-read the
durable state it cares about.

Delivery uses backpressure, not drops: received messages go through a bounded trio
memory channel (``max_buffer``). When the consumer falls behind, the reader stops
reading the socket, Redis buffers for us, and if Redis' own limit for pub/sub clients
(``client-output-buffer-limit pubsub``, 32 MB by default) is exceeded Redis drops the
connection, which shows up as ``reconnected``. While connected, nothing is silently
dropped.

It connects where its :class:`~mesh._topology.Topology` says the master is, and
shares that topology with the command connection: when either lands on a new master,
the other follows (key-expiry events are published only on the node holding the
keys).

Sharded pub/sub: ``subscribe(..., sharded=True)`` subscribes the channels both
ways, ``SUBSCRIBE`` and, where the server has it (Redis 7.0+) and the user may run
it, ``SSUBSCRIBE``; their messages come as ``message`` or ``smessage``. A
publisher's ``SPUBLISH`` then reaches us without a broadcast to every node of a
cluster, and a publisher that still uses ``PUBLISH`` (6.2, an older peer) is heard
too. Every sharded channel must hash to the slot of the node we sit on (the
route key's): the mesh's channels all carry the ``{namespace}`` hash tag. The
server's answers that mean "not here" are followed, not raised: a ``MOVED`` (or
``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``) to ``SSUBSCRIBE``, and a ``sunsubscribe``
we did not ask for (the node lost the slot in a migration or failover), break the
connection, and the reconnect finds the slot's master again (then
``reconnected``). An ``SSUBSCRIBE`` refused as unknown (6.2) or by the ACL leaves
that socket on plain ``SUBSCRIBE``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from ._errors import ClosedError, CommandError, ConfigError, MeshConnectionError, raise_single
from ._loop import ByteStream, aclose_forcefully
from ._pubsub_link import PubSubLink
from ._shielded import ShieldedTasks
from ._subscriptions import Message, Subscriptions
from ._subscriptions import names as to_names
from ._topology import Node, Topology
from ._transport import pack
from ._url import RedisConfig, coerce_config

__all__ = ["Message", "PubSub", "open_pubsub"]


class PubSub:
    """A pub/sub subscriber with its own connection. Get one from :func:`open_pubsub`.

    Iterate over it (``async for message in pubsub``) to receive :class:`Message`
    objects; there should be one consumer. Iteration ends when the pubsub is closed.
    """

    def __init__(
        self,
        config: RedisConfig,
        stream: ByteStream,
        reader: Any,
        *,
        name: str | None,
        ping_interval: float,
        max_buffer: int,
        topology: Topology | None = None,
        node: Node | None = None,
    ) -> None:
        self.config = config
        self.topology = topology if topology is not None else Topology(config)
        self._where = config.redacted()
        send, self._receive_messages = anyio.create_memory_object_stream[Message](max_buffer)
        self._subs = Subscriptions()
        self._link = PubSubLink(
            config,
            self.topology,
            stream,
            reader,
            self._subs,
            send,
            name=name,
            ping_interval=ping_interval,
            node=node,
        )

    # ---------------------------------------------------------------- public API

    @property
    def connected(self) -> bool:
        """Whether the connection is up (False while reconnecting and after close)."""
        return self._link.connected and not self._link.closed

    @property
    def sharded(self) -> bool:
        """Whether the sharded channels are also subscribed with ``SSUBSCRIBE`` on
        the current connection (False once the server refused it: before Redis
        7.0, or an ACL without ``ssubscribe``)."""
        return self._subs.shard_ok

    @property
    def reconnects(self) -> int:
        """How many times the connection was re-made after breaking."""
        return self._link.reconnects

    @property
    def _ping_interval(self) -> float:
        return self._link.ping_interval

    async def subscribe(self, *channels: bytes | str, sharded: bool = False) -> None:
        """Subscribe to channels and return once Redis confirmed every one.

        Args:
            *channels: channel names (``str`` is encoded as UTF-8).
            sharded: also subscribe them with ``SSUBSCRIBE`` where the server has it
                (see the module docstring); they must hash to the slot of the node
                this pubsub sits on. Messages then come as ``smessage`` from
                ``SPUBLISH`` and as ``message`` from ``PUBLISH``.

        Raises:
            CommandError: Redis refused (e.g. ``NOPERM`` for an ACL user); the
                channels are forgotten.
            MeshConnectionError: not confirmed within ``connect_timeout`` because the
                connection is down; the channels stay registered and are subscribed
                when it comes back (followed by a ``reconnected`` message).
            ClosedError: the pubsub was closed.
            ConfigError: no channel given, or a name of the wrong type.

        On cancellation, the channels stay registered (as if it had succeeded or
        timed out); call :meth:`unsubscribe` to drop them.
        """
        subs = self._subs
        names = self._check(to_names(channels, "channel"), "subscribe")
        subs.channels.update(names)
        if sharded:
            subs.sharded.update(names)
        await self._until(
            lambda: subs.commands(b"SUBSCRIBE", b"SSUBSCRIBE" if sharded else None, names),
            lambda: subs.subscribed(names, sharded),
            forget=(subs.channels, subs.sharded),
            what=b"SUBSCRIBE",
            names=names,
        )

    async def psubscribe(self, *patterns: bytes | str) -> None:
        """Subscribe to glob-style patterns; as :meth:`subscribe` otherwise."""
        subs = self._subs
        names = self._check(to_names(patterns, "pattern"), "psubscribe")
        subs.patterns.update(names)
        await self._until(
            lambda: subs.commands(b"PSUBSCRIBE", None, names),
            lambda: subs.confirmed_patterns.issuperset(names),
            forget=(subs.patterns,),
            what=b"PSUBSCRIBE",
            names=names,
        )

    async def unsubscribe(self, *channels: bytes | str) -> None:
        """Unsubscribe from channels (from all of them if none is given), both ways for
        sharded ones, and return once Redis confirmed it, or at once if the connection
        is down (they will not be re-subscribed). Messages published before the
        confirmation may still come.

        Raises:
            MeshConnectionError: not confirmed within ``connect_timeout``.
            ClosedError: the pubsub was closed.

        On cancellation, the channels are already forgotten: they will not be
        re-subscribed after a reconnect.
        """
        subs = self._subs
        names = to_names(channels, "channel") or sorted(subs.channels)
        self._check(names or [b""], "unsubscribe")
        sharded = [n for n in names if n in subs.sharded]
        subs.channels.difference_update(names)
        subs.sharded.difference_update(names)
        if not names:
            await anyio.lowlevel.checkpoint()
            return

        def commands() -> bytes:
            data = subs.commands(b"UNSUBSCRIBE", None, names)
            if sharded and subs.shard_ok:
                data += b"".join(pack((b"SUNSUBSCRIBE", *sharded)))
            return data

        await self._until(
            commands,
            lambda: subs.unsubscribed(names),
            what=b"UNSUBSCRIBE",
            names=names,
        )

    async def punsubscribe(self, *patterns: bytes | str) -> None:
        """Unsubscribe from patterns (all if none is given); as :meth:`unsubscribe`."""
        subs = self._subs
        names = to_names(patterns, "pattern") or sorted(subs.patterns)
        self._check(names or [b""], "punsubscribe")
        subs.patterns.difference_update(names)
        if not names:
            await anyio.lowlevel.checkpoint()
            return
        await self._until(
            lambda: subs.commands(b"PUNSUBSCRIBE", None, names),
            lambda: subs.confirmed_patterns.isdisjoint(names),
            what=b"PUNSUBSCRIBE",
            names=names,
        )

    def __aiter__(self) -> PubSub:
        return self

    async def __anext__(self) -> Message:
        """Wait for the next message.

        Raises:
            StopAsyncIteration: the pubsub was closed and every buffered message read.

        Cancellation is safe: no message is lost.
        """
        try:
            return await self._receive_messages.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    # ---------------------------------------------------------------- internals

    def _check(self, names: list[bytes], verb: str) -> list[bytes]:
        if self._link.closed:
            raise ClosedError(f"the pubsub connection to {self._where} is closed")
        if not names:
            raise ConfigError(f"{verb}() needs at least one name")
        return names

    async def _until(
        self,
        commands: Callable[[], bytes],
        done: Callable[[], bool],
        *,
        what: bytes,
        names: list[bytes],
        forget: tuple[set[bytes], ...] = (),
    ) -> None:
        """Send ``commands()`` on every new socket until ``done()`` holds."""
        await anyio.lowlevel.checkpoint()
        sent_generation = -1
        error_seq = self._link.error_seq
        with anyio.move_on_after(self.config.connect_timeout):
            while True:
                if self._link.closed:
                    raise ClosedError(f"the pubsub connection to {self._where} is closed")
                if self._link.error_seq != error_seq and self._link.last_error_reply is not None:
                    for registered in forget:
                        registered.difference_update(names)
                    reply = self._link.last_error_reply
                    raise CommandError(str(reply), code=reply.code)
                if done():
                    return
                if what.startswith(b"UN") or what.startswith(b"PUN"):
                    if not self._link.connected:
                        return  # nothing is subscribed on a socket that is down
                if self._link.connected and sent_generation != self._link.generation:
                    sent_generation = self._link.generation
                    await self._link.send(commands())
                    continue
                await self._link.changed.wait()
        raise MeshConnectionError(
            f"{what.decode()} on {self._where} not confirmed within connect_timeout="
            f"{self.config.connect_timeout:g}s (connected: {self._link.connected}; last error: "
            f"{self._link.last_error or 'none'})"
            + ("; it stays registered and will be made after a reconnect" if forget else "")
        )


@asynccontextmanager
async def open_pubsub(
    config: RedisConfig | str,
    *,
    name: str | None = None,
    ping_interval: float = 1.0,
    max_buffer: int = 1000,
    route_key: bytes | str | None = None,
    topology: Topology | None = None,
) -> AsyncIterator[PubSub]:
    """Open a pub/sub connection and yield a :class:`PubSub` for the ``async with`` block.

    Args:
        config: a :class:`RedisConfig` or a URL for :func:`parse_url`.
        name: the client name (``CLIENT SETNAME``).
        ping_interval: seconds between ``PING`` probes; no reply within twice this
            means the connection is dead and is re-made.
        max_buffer: messages buffered for the consumer before the reader stops
            reading the socket (backpressure; see the module docstring).
        route_key, topology: where to connect, as for
            :func:`~mesh._connection.open_connection`; pass the command
            connection's ``topology`` to stay on its node.

    Yields:
        The connected :class:`PubSub`, subscribed to nothing yet.

    Raises:
        MeshConnectionError: the first connect failed (within ``connect_timeout``).
        ConfigError: a bad URL, ``ping_interval`` or ``max_buffer``.

    Leaving the block closes the connection and cancels its trio tasks; iteration
    ends. Errors raised in the block come out unwrapped.
    """
    config = coerce_config(config)
    if not (ping_interval > 0 and math.isfinite(ping_interval)):
        raise ConfigError(f"ping_interval must be a positive number, not {ping_interval!r}")
    if max_buffer < 0:
        raise ConfigError(f"max_buffer must be >= 0, not {max_buffer!r}")
    if topology is None:
        topology = Topology(config, route_key)
    stream, reader, _, node = await topology.connect(name=name)
    pubsub = PubSub(
        config,
        stream,
        reader,
        name=name,
        ping_interval=ping_interval,
        max_buffer=max_buffer,
        topology=topology,
        node=node,
    )
    try:
        async with anyio.create_task_group() as nursery:
            # Shielded from the caller's cancellations until the block is
            # left: a block cancelled from outside can still (un)subscribe in
            # its shielded clean-up (a stopping worker unsubscribes).
            tasks = ShieldedTasks(nursery)
            try:
                await tasks.start(pubsub._link.run)
                yield pubsub
            finally:
                pubsub._link.close()
                tasks.cancel()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as eg:
        raise_single(eg)
    finally:
        pubsub._link.close()
        await aclose_forcefully(pubsub._link.stream)
