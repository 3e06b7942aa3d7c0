"""The socket of a :class:`~mesh._pubsub.PubSub`: reading, pinging, reconnecting.

:class:`PubSubLink` serves one socket at a time: a reader trio task that feeds the
server's replies to the subscription state (:mod:`mesh._subscriptions`) and the
messages to the consumer's channel, a ping trio task that finds a dead or
half-open socket, and a trio task that follows the master when the command
connection sharing the topology found a new one. When the socket breaks it
reconnects with backoff, re-subscribes everything asked for and delivers
``Message(kind="reconnected")`` first. The requests (subscribe, unsubscribe) and
the iteration stay on :class:`~mesh._pubsub.PubSub`.

Errors: a broken socket is never raised here: it is recorded (:attr:`PubSubLink.last_error`)
and the link reconnects; a reconnect attempt that fails raises MeshConnectionError
to the reconnect loop, which tries again.
"""

from __future__ import annotations

from typing import Any, Final

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectSendStream

from ._errors import CommandError, MeshConnectionError
from ._loop import ByteStream, aclose_forcefully
from ._reconnect import reconnect
from ._subscriptions import Message, Subscriptions
from ._topology import Node, Topology
from ._transport import CLOSED_ERRORS, TRANSPORT_ERRORS, describe, next_reply, scrub
from ._url import RedisConfig

__all__ = ["PubSubLink"]

_PING: Final = b"*1\r\n$4\r\nPING\r\n"
_SEND_ERRORS: Final = (*TRANSPORT_ERRORS, *CLOSED_ERRORS)
# Error codes that mean "this node does not serve the slot (now)".
_ELSEWHERE: Final = frozenset({"MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN"})
# The server's confirmations of (un)subscribing, for Subscriptions.confirm.
_CONFIRMATIONS: Final = frozenset(
    {b"subscribe", b"psubscribe", b"ssubscribe", b"unsubscribe", b"punsubscribe", b"sunsubscribe"}
)


class PubSubLink:
    """The connection loop of one pub/sub: the current socket, and what happens
    when it breaks. State read by :class:`~mesh._pubsub.PubSub`: ``connected``,
    ``closed``, ``generation`` (one per socket), ``changed`` (an event set and
    replaced on every change), ``error_seq``/``last_error_reply`` (the last error
    reply to a request) and ``last_error`` (why the socket last broke)."""

    def __init__(
        self,
        config: RedisConfig,
        topology: Topology,
        stream: ByteStream,
        reader: Any,
        subs: Subscriptions,
        messages: MemoryObjectSendStream[Message],
        *,
        name: str | None,
        ping_interval: float,
        node: Node | None,
    ) -> None:
        self.config = config
        self.topology = topology
        self.stream = stream
        self._reader = reader
        self._subs = subs
        self._send_messages = messages
        self._name = name
        self.ping_interval = ping_interval
        self._node = node
        self._where = config.redacted()
        self._send_lock = anyio.Lock()
        self.slot_moves = 0  # sharded channels found elsewhere (sunsubscribe, MOVED)
        self.connected = True
        self.closed = False
        self.generation = 0
        self.changed = anyio.Event()
        self.error_seq = 0
        self.last_error_reply: CommandError | None = None
        self.last_error = ""
        self._ping_sent_at: float | None = None
        self._delivering = False
        self._serve_scope: anyio.CancelScope | None = None
        self.reconnects = 0

    def notify(self) -> None:
        """Wake whoever waits on :attr:`changed` (a confirmation, an error, a new socket)."""
        self.changed.set()
        self.changed = anyio.Event()

    async def send(self, data: bytes) -> None:
        """Write to the current socket; a failure breaks it (the supervisor reconnects)."""
        stream, generation = self.stream, self.generation
        try:
            # Shielded: a send cancelled half-way would leave a partial command on the
            # wire. It cannot hang: when the socket is declared broken, _serve closes
            # it, which makes a blocked send_all raise ClosedResourceError.
            with anyio.CancelScope(shield=True):
                async with self._send_lock:
                    if generation == self.generation and self.connected:
                        await stream.send_all(data)
        except _SEND_ERRORS as exc:
            if generation == self.generation:
                self._broken(f"write failed: {describe(exc)}")

    def _broken(self, reason: str) -> None:
        if not self.connected:
            return
        self.connected = False
        self.last_error = scrub(reason, self.config)
        self._subs.lost()
        self._ping_sent_at = None
        if self._serve_scope is not None:
            self._serve_scope.cancel()
        self.notify()

    def close(self) -> None:
        """Closed by its owner: nothing is sent any more, and the iteration ends
        once the buffered messages are read. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.connected = False
        self._send_messages.close()
        self.notify()

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
            if kind in _CONFIRMATIONS:
                if self._subs.confirm(kind, reply[1]) and self.connected:
                    # Not asked for: the node no longer serves the channel's
                    # slot (a migration or failover). Find its new master.
                    self.slot_moves += 1
                    self._broken(
                        f"the server dropped sharded channel {reply[1]!r:.80} (its slot "
                        "moved); following it"
                    )
                self.notify()
                return None
        elif reply == b"PONG":
            self._ping_sent_at = None
            return None
        elif isinstance(reply, CommandError):
            if self._shard_refused(reply):
                return None
            if reply.code in _ELSEWHERE:
                # Only SSUBSCRIBE is routed by slot on a pubsub connection.
                self.slot_moves += 1
                self._broken(f"SSUBSCRIBE was answered {reply}; following the slot")
                return None
            self.last_error_reply = reply
            self.error_seq += 1
            self.notify()
            return None
        raise _UnexpectedReply(f"unexpected reply on a pubsub connection: {reply!r:.200}")

    def _shard_refused(self, reply: CommandError) -> bool:
        """An SSUBSCRIBE refused (unknown before 7.0, or the ACL): stay on SUBSCRIBE."""
        if not self._subs.shard_refused(reply):
            return False
        self.notify()
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

    async def run(
        self, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Supervisor trio task: serve the socket; when it breaks, reconnect and resubscribe."""
        task_status.started()
        initial: list[Message] = []
        while True:
            await self._serve(self.stream, self._reader, initial)
            if self.closed:
                await anyio.sleep_forever()
            stream, reader, early = await reconnect(
                self._reconnect_once, self._failed, self.topology.reached
            )
            self.stream, self._reader = stream, reader
            self.generation += 1
            self.reconnects += 1
            self._ping_sent_at = None
            self.connected = True
            initial = [Message("reconnected", b"", b""), *early]
            self.notify()

    def _failed(self, message: str) -> None:
        self.last_error = message

    async def _reconnect_once(self) -> tuple[ByteStream, Any, list[Message]]:
        stream, reader, _, node = await self.topology.connect(name=self._name)
        self._node = node
        # a new node: maybe another server version, which may take SSUBSCRIBE
        data, *wanted = self._subs.resubscribe()
        early: list[Message] = []
        try:
            with anyio.fail_after(self.config.connect_timeout):
                if data:
                    await stream.send_all(data)
                while not self._subs.restored(*wanted):
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
            self._subs.lost()
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
                if not self.connected:  # broken while we were starting
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
        interval = self.ping_interval
        while True:
            await anyio.sleep(interval)
            sent_at = self._ping_sent_at
            if sent_at is not None:
                if not self._delivering and anyio.current_time() - sent_at > 2 * interval:
                    self._broken(f"no reply to PING within {2 * interval:g}s")
                    return
                continue
            self._ping_sent_at = anyio.current_time()
            await self.send(_PING)


class _UnexpectedReply(Exception):
    """A reply a pubsub connection cannot explain: the stream is out of sync."""
