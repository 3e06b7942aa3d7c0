"""The reply loop beneath :class:`~mesh._connection.Connection`: one socket's
writer and reader trio tasks, auto-pipelining and FIFO reply matching.

How it moves bytes:

* :meth:`Wire._submit` takes a :class:`Waiter` (a caller's packed commands and its
  parked trio task) and appends it to the *pending* list, waking the writer if it
  sleeps, or, with ``direct_writes`` on a plain socket while the writer is idle,
  writes it at once from the calling trio task.
* One writer trio task takes everything pending and writes it with one
  ``send_all``: commands from many concurrent trio tasks share a socket write
  (auto-pipelining). Waiters move to the *in-flight* deque before the write.
* One reader trio task feeds the bytes it receives to a ``hiredis.Reader`` and hands
  each reply to the oldest in-flight waiter (Redis answers in order, so FIFO matching
  is exact).
* A waiter whose trio task was cancelled stays in its place and only swallows its
  reply, so FIFO matching is never disturbed. If it was cancelled before its
  command was written, the command is dropped instead.

When the socket breaks (:meth:`Wire._broken`), every in-flight and pending command
fails with :class:`~mesh.MeshConnectionError`. A re-route (``_rerouting``) stops
the writer and ends :meth:`Wire._serve` once every owed reply has arrived.
Reconnecting, re-routing and the public calls are the connection's
(:mod:`mesh._connection`); this module knows nothing of redirections.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio
import hiredis
import outcome
import trio

from ._asyncio_stream import AsyncioStream
from ._errors import ClosedError, MeshConnectionError
from ._loop import ByteStream, aclose_forcefully, current
from ._transport import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
from ._transport import RECEIVE_SIZE as _RECEIVE_SIZE
from ._transport import TRANSPORT_ERRORS as _TRANSPORT_ERRORS
from ._transport import Arg, describe, scrub
from ._transport import pack as _pack
from ._url import RedisConfig

__all__ = ["Waiter", "Wire", "fail_waiters"]

# Reads in a row that found data before the reader yields to trio anyway.
_FAIR_READS = 16


class Waiter:
    """One caller parked in :meth:`Connection.execute` or :meth:`Connection.pipeline`.

    ``expected`` replies are collected (1 for ``execute``) and then handed to
    ``task`` (the caller's :attr:`Loop.handle <mesh._loop.Loop>`) with the
    loop's ``wake``. ``cancelled`` means nobody waits for
    the replies any more: they are read and thrown away.
    """

    __slots__ = ("cancelled", "data", "expected", "replies", "task")

    def __init__(self, data: list[bytes | memoryview], expected: int, task: Any) -> None:
        self.task = task
        self.data = data
        self.expected = expected
        self.replies: list[Any] | None = [] if expected > 1 else None
        self.cancelled = False

    def abort(self, raise_cancel: object) -> trio.lowlevel.Abort:
        # Cancellation (or KeyboardInterrupt) of the waiting trio task: the waiter
        # keeps its place in the FIFO, only its replies will be discarded.
        self.cancelled = True
        return trio.lowlevel.Abort.SUCCEEDED


def fail_waiters(
    waiters: collections.deque[Waiter] | list[Waiter],
    make: Callable[[], BaseException],
    wake: Callable[[Any, Any], None],
) -> None:
    for waiter in waiters:
        if not waiter.cancelled:
            waiter.cancelled = True
            wake(waiter.task, outcome.Error(make()))
    waiters.clear()


class Wire:
    """The state and trio tasks that move one connection's bytes; the base of
    :class:`~mesh._connection.Connection`, which adds the public calls, the
    reconnects and the re-routes.

    Args:
        config: the connection's settings.
        stream, reader: the connected stream and its ``hiredis.Reader``.
        reconnect: whether a broken connection comes back (else it stays broken).
        reply_timeout: see :func:`~mesh._connection.open_connection`.
        direct_writes: see :func:`~mesh._connection.open_connection`.
    """

    config: RedisConfig

    def __init__(
        self,
        config: RedisConfig,
        stream: ByteStream,
        reader: Any,
        *,
        reconnect: bool,
        reply_timeout: float | None,
        direct_writes: bool,
    ) -> None:
        self.config = config
        self._where = config.redacted()
        # the running event loop's parking and waking (mesh/_loop.py)
        loop = self._loop = current()
        self._handle = loop.handle
        self._park = loop.park
        self._wake = loop.wake
        self._reconnect = reconnect
        self._reply_timeout = reply_timeout
        self._direct_writes = direct_writes
        self._stream = stream
        self._reader = reader
        # Writes are held and _serve ends once nothing is owed (a re-route).
        self._rerouting = False
        self._serve_scope: anyio.CancelScope | None = None
        self._pending: list[Waiter] = []
        self._in_flight: collections.deque[Waiter] = collections.deque()
        self._writer_task: Any = None  # the writer's handle while it is parked
        # The socket's file descriptor while _serve runs on a plain socket
        # stream (TCP or unix; -1: none, TLS, or not direct_writes): _submit
        # writes to it directly when the writer is idle.
        self._fd = -1
        # On asyncio, the protocol stream while _serve runs (direct_writes):
        # _submit writes to its transport at once, which never blocks.
        self._direct: AsyncioStream | None = None
        # What a direct write left unsent, for the writer to send first.
        self._unsent: bytes | memoryview = b""
        # A direct write was made since the reader last received data: the
        # next calls go through the writer, which sends them all in one
        # write (many callers in one trio tick still share writes).
        self._wrote = False
        self._connected = True
        self._connected_event = anyio.Event()
        self._connected_event.set()
        self._closed = False
        self._last_error = ""
        self._commands_sent = 0
        self._writes = 0
        self._in_flight_commands = 0

    def _submit(self, waiter: Waiter) -> None:
        """Queue ``waiter``'s commands for the writer (sync). When the writer
        is idle on a plain socket and no direct write was made since the
        reader last received data, write them now instead, without waking
        the writer (a trio task switch and a send_all per round trip saved):
        the socket is non-blocking, the write cannot be interrupted half way,
        and what it could not take (a full send buffer) or an error is left
        to the writer, which sends the rest first (or breaks the
        connection). The waiter is in flight from then on, as after the
        writer's send. Calls made right after a direct write wake the writer,
        which sends them together: concurrent calls still share writes.

        The caller is not cancelled (:meth:`~mesh._connection.Connection.execute` and ``pipeline``
        pass ``checkpoint_if_cancelled`` just before, with no checkpoint
        since): a cancelled call must never be sent, and a direct write
        cannot be taken back."""
        direct = self._direct
        if direct is not None and not (
            self._wrote or self._rerouting or self._pending or not self._connected
        ):
            # asyncio: the transport takes the whole write (it buffers what the
            # socket does not), so nothing is left unsent
            data = waiter.data
            self._in_flight.append(waiter)
            self._commands_sent += waiter.expected
            self._in_flight_commands += waiter.expected
            self._writes += 1
            self._wrote = True
            with contextlib.suppress(anyio.BrokenResourceError):  # lost: it breaks anyway
                direct.write(data[0] if len(data) == 1 else b"".join(data))
            return
        writer = self._writer_task
        if writer is None:
            self._pending.append(waiter)  # the writer is busy: it takes it next
            return
        if (
            self._wrote
            or self._fd < 0
            or self._rerouting
            or self._pending
            or self._unsent
            or not self._connected
        ):
            self._pending.append(waiter)
            self._writer_task = None
            self._wake(writer)
            return
        data = waiter.data
        buf = data[0] if len(data) == 1 else b"".join(data)
        self._in_flight.append(waiter)
        self._commands_sent += waiter.expected
        self._in_flight_commands += waiter.expected
        self._writes += 1
        self._wrote = True
        try:
            sent = os.write(self._fd, buf)
        except OSError:
            sent = 0  # a full buffer, or an error the writer meets again
        if sent < len(buf):
            self._unsent = memoryview(buf)[sent:] if sent else buf
            self._writer_task = None
            self._wake(writer)

    async def _send(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """Send ``commands`` back to back once; their replies, errors in place."""
        data: list[bytes | memoryview] = []
        for command in commands:
            data.extend(_pack(command))
        if not self._connected or self._closed:
            await self._wait_connected()
        await self._loop.checkpoint_if_cancelled()  # as in execute
        waiter = Waiter(data, len(commands), self._handle())
        self._submit(waiter)
        replies = await self._park(waiter.task, waiter.abort)
        return [replies] if len(commands) == 1 else list(replies)

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._connected = False
        self._connected_event.set()  # wake callers waiting for a reconnect
        closed = lambda: ClosedError(f"the connection to {self._where} was closed")  # noqa: E731
        fail_waiters(self._in_flight, closed, self._wake)
        fail_waiters(self._pending, closed, self._wake)
        self._in_flight_commands = 0
        writer = self._writer_task
        if writer is not None:
            # The writer wakes, sees nothing to do and parks again until cancelled.
            self._writer_task = None
            self._wake(writer)

    async def _wait_connected(self) -> None:
        """Wait (up to connect_timeout) for a reconnect in progress."""
        if self._closed:
            raise ClosedError(f"the connection to {self._where} is closed")
        if self._reconnect:
            with anyio.move_on_after(self.config.connect_timeout):
                await self._connected_event.wait()
        if self._closed:
            raise ClosedError(f"the connection to {self._where} is closed")
        if not self._connected:
            if self._reconnect:
                raise MeshConnectionError(
                    f"not connected to {self._where}: no reconnect within "
                    f"connect_timeout={self.config.connect_timeout:g}s "
                    f"(last error: {self._last_error})"
                )
            raise MeshConnectionError(
                f"the connection to {self._where} is broken (reconnect=False; "
                f"error: {self._last_error})"
            )

    def _broken(self, exc: BaseException | None, reason: str) -> None:
        """The socket of this generation is unusable: fail everything outstanding."""
        if not self._connected:
            return
        self._connected = False
        self._connected_event = anyio.Event()
        detail = scrub(reason if exc is None else f"{reason}: {describe(exc)}", self.config)
        self._last_error = detail
        in_flight_msg = (
            f"connection to {self._where} lost while the command was in flight "
            f"(it may or may not have run): {detail}"
        )
        pending_msg = f"connection to {self._where} lost before the command was sent: {detail}"

        def in_flight_error() -> MeshConnectionError:
            err = MeshConnectionError(in_flight_msg)
            err.__cause__ = exc
            return err

        def pending_error() -> MeshConnectionError:
            err = MeshConnectionError(pending_msg)
            err.__cause__ = exc
            return err

        fail_waiters(self._in_flight, in_flight_error, self._wake)
        fail_waiters(self._pending, pending_error, self._wake)
        self._in_flight_commands = 0

    async def _serve(
        self, stream: ByteStream, reader: Any, also: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        """Run the reader and the writer on one stream, and ``also`` beside them,
        until the stream breaks or a re-route has every owed reply; then close it."""
        try:
            async with anyio.create_task_group() as nursery:
                self._serve_scope = nursery.cancel_scope
                self._fd = _plain_fd(stream) if self._direct_writes else -1
                self._unsent = b""
                if self._rerouting and not self._in_flight:
                    nursery.cancel_scope.cancel()
                if isinstance(stream, AsyncioStream):
                    self._direct = stream if self._direct_writes else None
                    nursery.start_soon(self._consume, stream, reader, nursery.cancel_scope)
                else:
                    nursery.start_soon(self._read_loop, stream, reader, nursery.cancel_scope)
                nursery.start_soon(self._write_loop, stream, nursery.cancel_scope)
                nursery.start_soon(also)
        finally:
            self._serve_scope = None
            self._fd = -1
            self._direct = None
            self._unsent = b""
            await aclose_forcefully(stream)

    async def _write_loop(self, stream: ByteStream, scope: anyio.CancelScope) -> None:
        in_flight = self._in_flight
        try:
            while True:
                self._wrote = False
                if self._unsent:
                    # the rest of a direct write (see _submit): before anything else
                    await stream.send_all(self._unsent)
                    self._unsent = b""
                    continue
                batch = self._pending
                if not batch or self._rerouting:
                    self._writer_task = writer = self._handle()
                    await self._park(writer, self._abort_writer_wait)
                    continue
                self._pending = []
                chunks: list[bytes | memoryview] = []
                count = 0
                for waiter in batch:
                    if waiter.cancelled:
                        continue  # cancelled before it was written: drop it
                    in_flight.append(waiter)
                    chunks.extend(waiter.data)
                    count += waiter.expected
                if not count:
                    continue
                self._commands_sent += count
                self._in_flight_commands += count
                self._writes += 1
                await stream.send_all(chunks[0] if len(chunks) == 1 else b"".join(chunks))
        except _TRANSPORT_ERRORS as exc:
            self._break(scope, exc, "write failed")

    def _abort_writer_wait(self, raise_cancel: object) -> trio.lowlevel.Abort:
        self._writer_task = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _read_loop(self, stream: ByteStream, reader: Any, scope: anyio.CancelScope) -> None:
        """Hand each reply to the oldest in-flight waiter (the hot path); break the
        connection (cancelling ``scope``) when the stream fails or ends, a reply
        comes that nobody is owed, or replies are owed and nothing came for
        ``reply_timeout``; end (cancelling ``scope``) when a re-route has every
        owed reply.

        One cancel scope per ``reply_timeout`` period, not per receive: its
        deadline is when the last data arrived (or the wait began) plus
        ``reply_timeout``; when it passes, the loop looks at what really came.

        On a plain socket it reads the socket directly: a read that finds data
        does not yield to trio (trio's ``receive_some`` does, after each), one
        that finds none waits until it is readable. Every ``_FAIR_READS`` reads
        in a row without waiting, it yields anyway, so a flood of replies does
        not starve the other trio tasks. When the data read so far answered
        every call in flight, the next read would find nothing (the callers have
        not even run yet): it waits until the socket is readable first, rather
        than fail a read.
        """
        in_flight = self._in_flight
        timeout = self._reply_timeout or math.inf
        current_time = self._loop.clock()
        last = current_time()
        timed = timeout < math.inf  # else ``last`` is never looked at again
        fd = _plain_fd(stream)
        read = os.read
        streak = 0
        wait_first = False
        try:
            while True:
                with anyio.CancelScope(deadline=last + timeout) as waited:
                    while True:
                        if fd < 0:
                            data = await stream.receive_some(_RECEIVE_SIZE)
                        else:
                            if wait_first:
                                wait_first = False
                                streak = 0
                                await trio.lowlevel.wait_readable(fd)
                            try:
                                data = read(fd, _RECEIVE_SIZE)
                            except BlockingIOError:
                                wait_first = True  # nothing came yet
                                continue
                            self._wrote = False
                            streak += 1
                            if streak >= _FAIR_READS:
                                streak = 0
                                await trio.lowlevel.checkpoint()  # (fd: trio only)
                        if timed:
                            last = current_time()
                        if not data:
                            self._break(scope, None, "Redis closed the connection")
                            return
                        reader.feed(data)
                        unexpected = self._match(reader)
                        if unexpected is not None:
                            self._unexpected(scope, unexpected[0])
                            return
                        if not in_flight:
                            if self._rerouting:
                                scope.cancel()  # every owed reply arrived: re-route now
                                return
                            wait_first = True
                if waited.cancelled_caught:
                    now = current_time()
                    if not in_flight:
                        last = now  # idle: nothing is owed
                    elif now - last >= timeout:  # else data came meanwhile: wait from then
                        self._overdue(scope)
                        return
        except _TRANSPORT_ERRORS as exc:
            self._break(scope, exc, "read failed")

    def _match(self, reader: Any) -> tuple[Any] | None:
        """Hand each complete reply ``reader`` holds to the oldest in-flight
        waiter (Redis answers in order). Returns ``(reply,)`` for a reply that
        no call is owed (the stream is out of step), else None."""
        in_flight = self._in_flight
        wake = self._wake
        not_enough = _NOT_ENOUGH_DATA
        while True:
            reply = reader.gets()
            if reply is not_enough:
                return None
            if not in_flight:
                return (reply,)
            waiter = in_flight[0]
            replies = waiter.replies
            if replies is None:
                in_flight.popleft()
                self._in_flight_commands -= 1
                if not waiter.cancelled:
                    waiter.cancelled = True  # nobody may resolve it twice
                    wake(waiter.task, outcome.Value(reply))
            else:
                replies.append(reply)
                self._in_flight_commands -= 1
                if len(replies) == waiter.expected:
                    in_flight.popleft()
                    if not waiter.cancelled:
                        waiter.cancelled = True
                        wake(waiter.task, outcome.Value(replies))

    async def _consume(self, stream: AsyncioStream, reader: Any, scope: anyio.CancelScope) -> None:
        """:meth:`_read_loop` on asyncio: the protocol hands each received
        chunk to the reply matching as it arrives (no read of ours, and no
        task woken per read); this task only waits for the
        end (the connection lost or out of step, a re-route with every owed
        reply) and for ``reply_timeout`` to pass with replies owed."""
        in_flight = self._in_flight
        timeout = self._reply_timeout or math.inf
        clock = self._loop.clock()
        last = clock()
        ended = anyio.Event()
        why: list[tuple[str, Any]] = []

        def end(kind: str, detail: Any) -> None:
            if not why:
                why.append((kind, detail))
                ended.set()

        def on_data(data: bytes) -> None:
            nonlocal last
            last = clock()
            self._wrote = False
            if why:
                return
            reader.feed(data)
            try:
                unexpected = self._match(reader)
            except hiredis.ProtocolError as exc:
                end("failed", exc)
                return
            if unexpected is not None:
                end("unexpected", unexpected[0])
            elif not in_flight and self._rerouting:
                end("rerouted", None)

        def on_lost(exc: BaseException | None) -> None:
            end("failed" if exc is not None else "closed", exc)

        stream.consume(on_data, on_lost)
        try:
            while not why:
                with anyio.CancelScope(deadline=last + timeout) as waited:
                    await ended.wait()
                if waited.cancelled_caught and not why:
                    now = clock()
                    if not in_flight:
                        last = now  # idle: nothing is owed
                    elif now - last >= timeout:
                        self._overdue(scope)
                        return
        finally:
            stream.consume(None)
        kind, detail = why[0]
        if kind == "rerouted":
            scope.cancel()
        elif kind == "unexpected":
            self._unexpected(scope, detail)
        elif kind == "closed":
            self._break(scope, None, "Redis closed the connection")
        else:
            self._break(scope, detail, "read failed")

    def _break(self, scope: anyio.CancelScope, exc: BaseException | None, reason: str) -> None:
        """:meth:`_broken`, and end :meth:`_serve` (cancel its ``scope``)."""
        self._broken(exc, reason)
        scope.cancel()

    def _unexpected(self, scope: anyio.CancelScope, reply: object) -> None:
        """A reply came that no call is owed: the stream is out of step."""
        self._break(scope, None, f"protocol error: unexpected reply {reply!r:.100}")

    def _overdue(self, scope: anyio.CancelScope) -> None:
        """Replies are owed and nothing came for ``reply_timeout``: a half-open
        socket (the peer host vanished, a NAT forgot the flow). Break it so the
        connection reconnects instead of waiting for TCP."""
        self._break(scope, None, f"no reply within reply_timeout={self._reply_timeout:g}s")


def _plain_fd(stream: ByteStream) -> int:
    """The file descriptor of a plain trio socket stream (TCP or unix), which
    the connection reads and writes directly; -1 for any other stream (TLS,
    or any stream on asyncio)."""
    if type(stream) is trio.SocketStream:
        return stream.socket.fileno()
    return -1
