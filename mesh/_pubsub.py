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
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, Final, Literal

import anyio
import anyio.abc
import anyio.lowlevel
import attrs

from ._errors import ClosedError, CommandError, ConfigError, MeshConnectionError, raise_single
from ._loop import ByteStream, aclose_forcefully
from ._shielded import ShieldedTasks
from ._topology import Node, Topology
from ._transport import (
    CLOSED_ERRORS,
    TRANSPORT_ERRORS,
    describe,
    next_reply,
    pack,
    reconnect,
    scrub,
)
from ._url import RedisConfig, coerce_config

__all__ = ["Message", "PubSub", "open_pubsub"]

_PING: Final = b"*1\r\n$4\r\nPING\r\n"
_SEND_ERRORS: Final = (*TRANSPORT_ERRORS, *CLOSED_ERRORS)
# Error codes that mean "this node does not serve the slot (now)".
_ELSEWHERE: Final = frozenset({"MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN"})


@attrs.frozen
class Message:
    """One event from a :class:`PubSub`.

    Attributes:
        kind: ``"message"`` (from a channel subscription), ``"smessage"`` (from a
            sharded channel subscription: an ``SPUBLISH``), ``"pmessage"`` (from a
            pattern subscription) or ``"reconnected"`` (the connection was re-made
            and every subscription restored; messages may have been missed).
        channel: the channel it was published on (``b""`` for ``reconnected``).
        data: the payload, byte for byte (``b""`` for ``reconnected``).
        pattern: the matching pattern, for ``pmessage`` only.
    """

    kind: Literal["message", "smessage", "pmessage", "reconnected"]
    channel: bytes
    data: bytes
    pattern: bytes | None = None


def _names(names: Iterable[bytes | str], what: str) -> list[bytes]:
    out: list[bytes] = []
    for name in names:
        if isinstance(name, str):
            out.append(name.encode())
        elif isinstance(name, bytes):
            out.append(name)
        else:
            raise ConfigError(f"a {what} must be bytes or str, not {type(name).__name__}")
    return out


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
        self._node = node
        self._name = name
        self._ping_interval = ping_interval
        self._where = config.redacted()
        self._stream = stream
        self._reader = reader
        self._send_messages, self._receive_messages = anyio.create_memory_object_stream[Message](
            max_buffer
        )
        self._send_lock = anyio.Lock()
        self._channels: set[bytes] = set()  # what the caller asked for
        self._patterns: set[bytes] = set()
        self._confirmed_channels: set[bytes] = set()  # what Redis confirmed on this socket
        self._confirmed_patterns: set[bytes] = set()
        self._sharded: set[bytes] = set()  # of self._channels, also wanted sharded
        self._confirmed_sharded: set[bytes] = set()
        # Whether this socket takes SSUBSCRIBE: unknown until refused (6.2, ACL).
        self._shard_ok = True
        self._slot_moves = 0  # sharded channels found elsewhere (sunsubscribe, MOVED)
        self._connected = True
        self._closed = False
        self._generation = 0
        self._changed = anyio.Event()
        self._error_seq = 0
        self._last_error_reply: CommandError | None = None
        self._last_error = ""
        self._ping_sent_at: float | None = None
        self._delivering = False
        self._serve_scope: anyio.CancelScope | None = None
        self._reconnects = 0

    # ---------------------------------------------------------------- public API

    @property
    def connected(self) -> bool:
        """Whether the connection is up (False while reconnecting and after close)."""
        return self._connected and not self._closed

    @property
    def sharded(self) -> bool:
        """Whether the sharded channels are also subscribed with ``SSUBSCRIBE`` on
        the current connection (False once the server refused it: before Redis
        7.0, or an ACL without ``ssubscribe``)."""
        return self._shard_ok

    @property
    def reconnects(self) -> int:
        """How many times the connection was re-made after breaking."""
        return self._reconnects

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
        names = self._check(_names(channels, "channel"), "subscribe")
        self._channels.update(names)
        if sharded:
            self._sharded.update(names)
        await self._until(
            lambda: self._commands(b"SUBSCRIBE", b"SSUBSCRIBE" if sharded else None, names),
            lambda: (
                self._confirmed_channels.issuperset(names)
                and (not sharded or not self._shard_ok or self._confirmed_sharded.issuperset(names))
            ),
            forget=(self._channels, self._sharded),
            what=b"SUBSCRIBE",
            names=names,
        )

    async def psubscribe(self, *patterns: bytes | str) -> None:
        """Subscribe to glob-style patterns; as :meth:`subscribe` otherwise."""
        names = self._check(_names(patterns, "pattern"), "psubscribe")
        self._patterns.update(names)
        await self._until(
            lambda: self._commands(b"PSUBSCRIBE", None, names),
            lambda: self._confirmed_patterns.issuperset(names),
            forget=(self._patterns,),
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
        names = _names(channels, "channel") or sorted(self._channels)
        self._check(names or [b""], "unsubscribe")
        sharded = [n for n in names if n in self._sharded]
        self._channels.difference_update(names)
        self._sharded.difference_update(names)
        if not names:
            await anyio.lowlevel.checkpoint()
            return

        def commands() -> bytes:
            data = self._commands(b"UNSUBSCRIBE", None, names)
            if sharded and self._shard_ok:
                data += b"".join(pack((b"SUNSUBSCRIBE", *sharded)))
            return data

        await self._until(
            commands,
            lambda: (
                self._confirmed_channels.isdisjoint(names)
                and self._confirmed_sharded.isdisjoint(names)
            ),
            what=b"UNSUBSCRIBE",
            names=names,
        )

    async def punsubscribe(self, *patterns: bytes | str) -> None:
        """Unsubscribe from patterns (all if none is given); as :meth:`unsubscribe`."""
        names = _names(patterns, "pattern") or sorted(self._patterns)
        self._check(names or [b""], "punsubscribe")
        self._patterns.difference_update(names)
        if not names:
            await anyio.lowlevel.checkpoint()
            return
        await self._until(
            lambda: self._commands(b"PUNSUBSCRIBE", None, names),
            lambda: self._confirmed_patterns.isdisjoint(names),
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
        if self._closed:
            raise ClosedError(f"the pubsub connection to {self._where} is closed")
        if not names:
            raise ConfigError(f"{verb}() needs at least one name")
        return names

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _commands(self, command: bytes, sharded: bytes | None, names: list[bytes]) -> bytes:
        """``command names``, and ``sharded names`` if this socket takes it."""
        data = b"".join(pack((command, *names)))
        if sharded is not None and self._shard_ok:
            data += b"".join(pack((sharded, *names)))
        return data

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
        error_seq = self._error_seq
        with anyio.move_on_after(self.config.connect_timeout):
            while True:
                if self._closed:
                    raise ClosedError(f"the pubsub connection to {self._where} is closed")
                if self._error_seq != error_seq and self._last_error_reply is not None:
                    for registered in forget:
                        registered.difference_update(names)
                    reply = self._last_error_reply
                    raise CommandError(str(reply), code=reply.code)
                if done():
                    return
                if what.startswith(b"UN") or what.startswith(b"PUN"):
                    if not self._connected:
                        return  # nothing is subscribed on a socket that is down
                if self._connected and sent_generation != self._generation:
                    sent_generation = self._generation
                    await self._send(commands())
                    continue
                await self._changed.wait()
        raise MeshConnectionError(
            f"{what.decode()} on {self._where} not confirmed within connect_timeout="
            f"{self.config.connect_timeout:g}s (connected: {self._connected}; last error: "
            f"{self._last_error or 'none'})"
            + ("; it stays registered and will be made after a reconnect" if forget else "")
        )

    async def _send(self, data: bytes) -> None:
        """Write to the current socket; a failure breaks it (the supervisor reconnects)."""
        stream, generation = self._stream, self._generation
        try:
            # Shielded: a send cancelled half-way would leave a partial command on the
            # wire. It cannot hang: when the socket is declared broken, _serve closes
            # it, which makes a blocked send_all raise ClosedResourceError.
            with anyio.CancelScope(shield=True):
                async with self._send_lock:
                    if generation == self._generation and self._connected:
                        await stream.send_all(data)
        except _SEND_ERRORS as exc:
            if generation == self._generation:
                self._broken(f"write failed: {describe(exc)}")

    def _broken(self, reason: str) -> None:
        if not self._connected:
            return
        self._connected = False
        self._last_error = scrub(reason, self.config)
        self._confirmed_channels.clear()
        self._confirmed_patterns.clear()
        self._confirmed_sharded.clear()
        self._ping_sent_at = None
        if self._serve_scope is not None:
            self._serve_scope.cancel()
        self._notify()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._connected = False
        self._send_messages.close()
        self._notify()

    def _handle(self, reply: Any) -> Message | None:
        """Update the subscription state from one reply; return it if it is a message."""
        if isinstance(reply, list) and reply and isinstance(reply[0], bytes):
            kind = reply[0]
            if kind == b"message" and len(reply) == 3:
                return Message("message", reply[1], reply[2])
            if kind == b"smessage" and len(reply) == 3:
                return Message("smessage", reply[1], reply[2])
            if kind == b"pmessage" and len(reply) == 4:
                return Message("pmessage", reply[2], reply[3], pattern=reply[1])
            if kind == b"pong":
                self._ping_sent_at = None
                return None
            if kind in (b"ssubscribe", b"sunsubscribe"):
                name = reply[1]
                if kind == b"ssubscribe":
                    self._confirmed_sharded.add(name)
                else:
                    self._confirmed_sharded.discard(name)
                    if name in self._sharded and self._connected:
                        # Not asked for: the node no longer serves the channel's
                        # slot (a migration or failover). Find its new master.
                        self._slot_moves += 1
                        self._broken(
                            f"the server dropped sharded channel {name!r:.80} (its slot "
                            "moved); following it"
                        )
                self._notify()
                return None
            if kind in (b"subscribe", b"psubscribe", b"unsubscribe", b"punsubscribe"):
                name = reply[1]
                if isinstance(name, bytes):
                    target = (
                        self._confirmed_patterns
                        if kind.startswith(b"p")
                        else self._confirmed_channels
                    )
                    if kind.endswith(b"unsubscribe"):
                        target.discard(name)
                    else:
                        target.add(name)
                self._notify()
                return None
        elif reply == b"PONG":
            self._ping_sent_at = None
            return None
        elif isinstance(reply, CommandError):
            if self._shard_refused(reply):
                return None
            if reply.code in _ELSEWHERE:
                # Only SSUBSCRIBE is routed by slot on a pubsub connection.
                self._slot_moves += 1
                self._broken(f"SSUBSCRIBE was answered {reply}; following the slot")
                return None
            self._last_error_reply = reply
            self._error_seq += 1
            self._notify()
            return None
        raise _UnexpectedReply(f"unexpected reply on a pubsub connection: {reply!r:.200}")

    def _shard_refused(self, reply: CommandError) -> bool:
        """An SSUBSCRIBE refused (unknown before 7.0, or the ACL): stay on SUBSCRIBE."""
        text = str(reply).lower()
        if "ssubscribe" not in text or reply.code not in ("ERR", "NOPERM"):
            return False
        if self._shard_ok:
            self._shard_ok = False
            self._confirmed_sharded.clear()
            self._notify()
        return True

    async def _deliver(self, message: Message) -> None:
        self._delivering = True
        try:
            await self._send_messages.send(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # closed, or nobody is reading any more: nothing to deliver to
        finally:
            self._delivering = False
            if self._ping_sent_at is not None:
                # The socket was not read while we waited for the consumer: give the
                # outstanding PING a fresh deadline instead of calling the link dead.
                self._ping_sent_at = anyio.current_time()

    async def _run(
        self, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Supervisor trio task: serve the socket; when it breaks, reconnect and resubscribe."""
        task_status.started()
        initial: list[Message] = []
        while True:
            await self._serve(self._stream, self._reader, initial)
            if self._closed:
                await anyio.sleep_forever()
            stream, reader, early = await reconnect(
                self._reconnect_once, self._failed, self.topology.reached
            )
            self._stream, self._reader = stream, reader
            self._generation += 1
            self._reconnects += 1
            self._ping_sent_at = None
            self._connected = True
            initial = [Message("reconnected", b"", b""), *early]
            self._notify()

    def _failed(self, message: str) -> None:
        self._last_error = message

    async def _reconnect_once(self) -> tuple[ByteStream, Any, list[Message]]:
        stream, reader, _, node = await self.topology.connect(name=self._name)
        self._node = node
        channels, patterns = set(self._channels), set(self._patterns)
        sharded = self._sharded & channels
        self._shard_ok = True  # a new node: maybe another server version
        early: list[Message] = []
        try:
            with anyio.fail_after(self.config.connect_timeout):
                data = b""
                if channels:
                    data += b"".join(pack((b"SUBSCRIBE", *sorted(channels))))
                if sharded:
                    data += b"".join(pack((b"SSUBSCRIBE", *sorted(sharded))))
                if patterns:
                    data += b"".join(pack((b"PSUBSCRIBE", *sorted(patterns))))
                if data:
                    await stream.send_all(data)
                while not (
                    self._confirmed_channels.issuperset(channels)
                    and self._confirmed_patterns.issuperset(patterns)
                    and (not self._shard_ok or self._confirmed_sharded.issuperset(sharded))
                ):
                    reply = await next_reply(stream, reader)
                    if isinstance(reply, CommandError) and self._shard_refused(reply):
                        continue
                    if isinstance(reply, CommandError):
                        raise MeshConnectionError(
                            f"re-subscribing on {self._where} failed: {reply}"
                        )
                    message = self._handle(reply)
                    if message is not None:
                        early.append(message)
        except BaseException as exc:
            self._confirmed_channels.clear()
            self._confirmed_patterns.clear()
            self._confirmed_sharded.clear()
            await aclose_forcefully(stream)
            if isinstance(exc, TimeoutError):
                raise MeshConnectionError(
                    f"re-subscribing on {self._where} took longer than connect_timeout"
                ) from None
            if isinstance(exc, (*TRANSPORT_ERRORS, _UnexpectedReply)):
                raise MeshConnectionError(
                    scrub(f"re-subscribing on {self._where} failed: {describe(exc)}", self.config)
                ) from exc
            raise
        return stream, reader, early

    async def _serve(self, stream: ByteStream, reader: Any, initial: list[Message]) -> None:
        try:
            async with anyio.create_task_group() as nursery:
                self._serve_scope = nursery.cancel_scope
                if not self._connected:  # broken while we were starting
                    nursery.cancel_scope.cancel()
                nursery.start_soon(self._read_loop, stream, reader, initial)
                nursery.start_soon(self._ping_loop)
                nursery.start_soon(self._follow_master)
        finally:
            self._serve_scope = None
            # A send in progress from a subscribe() caller fails with
            # ClosedResourceError, which _send ignores for an old socket.
            await aclose_forcefully(stream)

    async def _read_loop(self, stream: ByteStream, reader: Any, initial: list[Message]) -> None:
        for first in initial:
            await self._deliver(first)
        try:
            while True:
                try:
                    reply = await next_reply(stream, reader)
                except anyio.BrokenResourceError as exc:
                    self._broken(str(exc))
                    return
                message = self._handle(reply)
                if message is not None:
                    await self._deliver(message)
        except TRANSPORT_ERRORS as exc:
            self._broken(f"read failed: {describe(exc)}")
        except _UnexpectedReply as exc:
            self._broken(str(exc))

    async def _follow_master(self) -> None:
        """Reconnect when the command connection sharing our topology found a new master."""
        node = self._node
        if node is None or self.config.path is not None:
            await anyio.sleep_forever()
        assert node is not None
        await self.topology.wait_moved(node)
        self._broken(f"the master moved to {self.topology.master}")

    async def _ping_loop(self) -> None:
        interval = self._ping_interval
        while True:
            await anyio.sleep(interval)
            sent_at = self._ping_sent_at
            if sent_at is not None:
                if not self._delivering and anyio.current_time() - sent_at > 2 * interval:
                    self._broken(f"no reply to PING within {2 * interval:g}s")
                    return
                continue
            self._ping_sent_at = anyio.current_time()
            await self._send(_PING)


class _UnexpectedReply(Exception):
    """A reply a pubsub connection cannot explain: the stream is out of sync."""


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
                await tasks.start(pubsub._run)
                yield pubsub
            finally:
                pubsub._close()
                tasks.cancel()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as eg:
        raise_single(eg)
    finally:
        pubsub._close()
        await aclose_forcefully(pubsub._stream)
