"""The trio-native Redis connection: trio streams, hiredis, auto-pipelining, reconnect.

How it moves bytes:

* :meth:`Connection.execute` packs its command (redis-py's sans-IO
  ``PythonRespSerializer``), appends a small waiter to the *pending* list, wakes the
  writer if it sleeps, and parks its trio task until the reply arrives.
* One writer trio task takes everything pending and writes it with one
  ``send_all``: commands from many concurrent trio tasks share a socket write
  (auto-pipelining). Waiters move to the *in-flight* deque before the write.
* One reader trio task feeds the bytes it receives to a ``hiredis.Reader`` and hands
  each reply to the oldest in-flight waiter (Redis answers in order, so FIFO matching
  is exact).
* A waiter whose trio task was cancelled stays in its place and only swallows its
  reply, so FIFO matching is never disturbed. If it was cancelled before its
  command was written, the command is dropped instead.

When the socket breaks, every in-flight and pending command fails with
:class:`~mesh.MeshConnectionError` (for commands that were written, it is unknown
whether Redis ran them), and a background trio task reconnects with exponential
backoff and jitter. Calls made meanwhile wait up to ``connect_timeout`` for the
reconnect.

Replies are RESP2 and never decoded: bulk strings are ``bytes``, integers ``int``,
nil ``None``, arrays ``list``. Error replies become :class:`~mesh.CommandError`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import outcome
import trio

from ._errors import ClosedError, CommandError, MeshConnectionError, raise_single
from ._transport import ENCODER as _ENCODER
from ._transport import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
from ._transport import RECEIVE_SIZE as _RECEIVE_SIZE
from ._transport import TRANSPORT_ERRORS as _TRANSPORT_ERRORS
from ._transport import Arg, coerce_config, connect, describe, reconnect, scrub
from ._transport import make_reader as _make_reader
from ._transport import pack as _pack
from ._transport import pack_command as _pack_command
from ._url import RedisConfig

__all__ = ["Connection", "ConnectionStatistics", "connect", "open_connection"]

# Re-exported for the contract tests of the sans-IO parts (tests/test_redis_contract.py).
_CONTRACT = (_ENCODER, _make_reader, _pack_command)


@attrs.frozen
class ConnectionStatistics:
    """A snapshot of a connection's counters, from :meth:`Connection.statistics`.

    Attributes:
        commands_sent: commands written to sockets since the connection was opened.
        writes: socket writes (``send_all`` calls); fewer than ``commands_sent``
            when commands were pipelined.
        reconnects: successful reconnects after a broken socket.
        in_flight: commands written and not yet answered.
    """

    commands_sent: int
    writes: int
    reconnects: int
    in_flight: int


class _Waiter:
    """One caller parked in :meth:`Connection.execute` or :meth:`Connection.pipeline`.

    ``expected`` replies are collected (1 for ``execute``) and then handed to
    ``task`` with ``trio.lowlevel.reschedule``. ``cancelled`` means nobody waits for
    the replies any more: they are read and thrown away.
    """

    __slots__ = ("cancelled", "data", "expected", "replies", "task")

    def __init__(self, data: list[bytes | memoryview], expected: int) -> None:
        self.task = trio.lowlevel.current_task()
        self.data = data
        self.expected = expected
        self.replies: list[Any] | None = [] if expected > 1 else None
        self.cancelled = False

    def abort(self, raise_cancel: object) -> trio.lowlevel.Abort:
        # Cancellation (or KeyboardInterrupt) of the waiting trio task: the waiter
        # keeps its place in the FIFO, only its replies will be discarded.
        self.cancelled = True
        return trio.lowlevel.Abort.SUCCEEDED


def _fail_waiters(
    waiters: collections.deque[_Waiter] | list[_Waiter], make: Callable[[], BaseException]
) -> None:
    for waiter in waiters:
        if not waiter.cancelled:
            waiter.cancelled = True
            trio.lowlevel.reschedule(waiter.task, outcome.Error(make()))
    waiters.clear()


class Connection:
    """One Redis connection shared by any number of trio tasks. Get one from
    :func:`open_connection`.

    Concurrent calls are pipelined automatically: what is queued while a write is in
    progress goes out in the next single write.
    """

    config: RedisConfig

    def __init__(
        self,
        config: RedisConfig,
        stream: trio.abc.Stream,
        reader: Any,
        *,
        name: str | None,
        reconnect: bool,
        reply_timeout: float | None = None,
    ) -> None:
        self.config = config
        self._name = name
        self._reconnect = reconnect
        self._reply_timeout = reply_timeout
        self._stream = stream
        self._reader = reader
        self._where = config.redacted()
        self._pending: list[_Waiter] = []
        self._in_flight: collections.deque[_Waiter] = collections.deque()
        self._writer_task: trio.lowlevel.Task | None = None
        self._connected = True
        self._connected_event = trio.Event()
        self._connected_event.set()
        self._closed = False
        self._last_error = ""
        self._commands_sent = 0
        self._writes = 0
        self._reconnects = 0
        self._in_flight_commands = 0

    # ---------------------------------------------------------------- public API

    @property
    def connected(self) -> bool:
        """Whether the socket is up right now (False while reconnecting and after close)."""
        return self._connected and not self._closed

    def statistics(self) -> ConnectionStatistics:
        """Return a snapshot of the counters (see :class:`ConnectionStatistics`)."""
        return ConnectionStatistics(
            commands_sent=self._commands_sent,
            writes=self._writes,
            reconnects=self._reconnects,
            in_flight=self._in_flight_commands,
        )

    async def execute(self, *args: Arg) -> Any:
        """Send one command and return its reply.

        Args:
            *args: the command name and its arguments; ``str`` is sent as UTF-8,
                ``int`` and ``float`` as their ``repr``, ``bytes`` as is. A first
                argument with spaces (``"CLIENT KILL"``) is split into words.

        Returns:
            The reply, undecoded: ``bytes``, ``int``, ``None`` or a ``list`` of those
            (error replies nested in a list are :class:`CommandError` values).

        Raises:
            CommandError: Redis answered with an error; ``.code`` is its first word.
            MeshConnectionError: the connection broke while the command was in flight
                (unknown whether Redis ran it), or it is down and did not come back
                within ``connect_timeout``.
            ClosedError: the connection was closed.
            ConfigError: an argument has an unsupported type (nothing was sent).

        On cancellation, the command is dropped if it was not written yet; otherwise
        Redis still runs it and its reply is discarded.
        """
        data = _pack(args)
        if not self._connected or self._closed:
            await self._wait_connected()
        waiter = _Waiter(data, 1)
        self._pending.append(waiter)
        writer = self._writer_task
        if writer is not None:
            self._writer_task = None
            trio.lowlevel.reschedule(writer)
        reply = await trio.lowlevel.wait_task_rescheduled(waiter.abort)
        if type(reply) is CommandError:
            raise reply
        return reply

    async def pipeline(
        self,
        commands: Sequence[Sequence[Arg]],
        *,
        raise_on_error: bool = True,
    ) -> list[Any]:
        """Send several commands back to back (one write, no other command in between)
        and return their replies. This is not a transaction: wrap the commands in
        ``MULTI``/``EXEC`` for that.

        Args:
            commands: each a sequence of a command name and its arguments.
            raise_on_error: if true, raise the first error reply (after all replies
                arrived); if false, return error replies in place as
                :class:`CommandError` values.

        Returns:
            One reply per command, in order.

        Raises:
            CommandError: a command got an error reply and ``raise_on_error`` is true.
                The other commands ran.
            MeshConnectionError, ClosedError, ConfigError: as for :meth:`execute`.

        On cancellation, as for :meth:`execute`: the whole pipeline is dropped if not
        written yet, otherwise its replies are discarded.
        """
        if not commands:
            await trio.lowlevel.checkpoint()
            return []
        data: list[bytes | memoryview] = []
        for command in commands:
            data.extend(_pack(command))
        if not self._connected or self._closed:
            await self._wait_connected()
        waiter = _Waiter(data, len(commands))
        self._pending.append(waiter)
        writer = self._writer_task
        if writer is not None:
            self._writer_task = None
            trio.lowlevel.reschedule(writer)
        replies: list[Any] = await trio.lowlevel.wait_task_rescheduled(waiter.abort)
        if len(commands) == 1:
            replies = [replies]
        if raise_on_error:
            for i, reply in enumerate(replies):
                if type(reply) is CommandError:
                    reply.add_note(f"(reply {i} of a pipeline of {len(commands)} commands)")
                    raise reply
        return replies

    async def aclose(self) -> None:
        """Close the connection. Calls still waiting fail with :class:`ClosedError`,
        later calls raise it. Idempotent. Leaving the ``async with`` block of
        :func:`open_connection` does the same and also stops its trio tasks.

        This is a checkpoint; closing is done even if it is cancelled.
        """
        self._close()
        await trio.lowlevel.checkpoint()

    # ---------------------------------------------------------------- internals

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._connected = False
        self._connected_event.set()  # wake callers waiting for a reconnect
        closed = lambda: ClosedError(f"the connection to {self._where} was closed")  # noqa: E731
        _fail_waiters(self._in_flight, closed)
        _fail_waiters(self._pending, closed)
        self._in_flight_commands = 0
        writer = self._writer_task
        if writer is not None:
            # The writer wakes, sees nothing to do and parks again until cancelled.
            self._writer_task = None
            trio.lowlevel.reschedule(writer)

    async def _wait_connected(self) -> None:
        """Wait (up to connect_timeout) for a reconnect in progress."""
        if self._closed:
            raise ClosedError(f"the connection to {self._where} is closed")
        if self._reconnect:
            with trio.move_on_after(self.config.connect_timeout):
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
        self._connected_event = trio.Event()
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

        _fail_waiters(self._in_flight, in_flight_error)
        _fail_waiters(self._pending, pending_error)
        self._in_flight_commands = 0

    async def _run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The connection's supervisor trio task: serve, and reconnect when broken."""
        task_status.started()
        while True:
            await self._serve(self._stream, self._reader)
            if self._closed or not self._reconnect:
                # Stay broken: calls raise MeshConnectionError / ClosedError.
                await trio.sleep_forever()
            stream, reader = await self._reconnect_with_backoff()
            self._stream, self._reader = stream, reader
            self._in_flight = collections.deque()
            self._pending = [w for w in self._pending if not w.cancelled]
            self._connected = True
            self._reconnects += 1
            self._connected_event.set()

    async def _reconnect_with_backoff(self) -> tuple[trio.abc.Stream, Any]:
        async def attempt() -> tuple[trio.abc.Stream, Any]:
            stream, reader, _ = await connect(self.config, name=self._name)
            return stream, reader

        def failed(message: str) -> None:
            self._last_error = message

        return await reconnect(attempt, failed)

    async def _serve(self, stream: trio.abc.Stream, reader: Any) -> None:
        """Run the reader and the writer on one stream until it breaks."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_loop, stream, reader, nursery.cancel_scope)
                nursery.start_soon(self._write_loop, stream, nursery.cancel_scope)
        finally:
            await trio.aclose_forcefully(stream)

    async def _write_loop(self, stream: trio.abc.Stream, scope: trio.CancelScope) -> None:
        in_flight = self._in_flight
        try:
            while True:
                batch = self._pending
                if not batch:
                    self._writer_task = trio.lowlevel.current_task()
                    await trio.lowlevel.wait_task_rescheduled(self._abort_writer_wait)
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
            self._broken(exc, "write failed")
            scope.cancel()

    def _abort_writer_wait(self, raise_cancel: object) -> trio.lowlevel.Abort:
        self._writer_task = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _read_loop(
        self, stream: trio.abc.Stream, reader: Any, scope: trio.CancelScope
    ) -> None:
        in_flight = self._in_flight
        reschedule = trio.lowlevel.reschedule
        not_enough = _NOT_ENOUGH_DATA
        try:
            while True:
                with trio.move_on_after(self._reply_timeout or math.inf) as waited:
                    data = await stream.receive_some(_RECEIVE_SIZE)
                if waited.cancelled_caught:
                    if not in_flight:
                        continue  # idle: nothing is owed
                    # Replies are owed and nothing came: a half-open socket
                    # (the peer host vanished, a NAT forgot the flow). Break it
                    # so the connection reconnects instead of waiting for TCP.
                    self._broken(None, f"no reply within reply_timeout={self._reply_timeout:g}s")
                    scope.cancel()
                    return
                if not data:
                    self._broken(None, "Redis closed the connection")
                    scope.cancel()
                    return
                reader.feed(data)
                while True:
                    reply = reader.gets()
                    if reply is not_enough:
                        break
                    if not in_flight:
                        self._broken(None, f"protocol error: unexpected reply {reply!r:.100}")
                        scope.cancel()
                        return
                    waiter = in_flight[0]
                    replies = waiter.replies
                    if replies is None:
                        in_flight.popleft()
                        self._in_flight_commands -= 1
                        if not waiter.cancelled:
                            waiter.cancelled = True  # nobody may resolve it twice
                            reschedule(waiter.task, outcome.Value(reply))
                    else:
                        replies.append(reply)
                        self._in_flight_commands -= 1
                        if len(replies) == waiter.expected:
                            in_flight.popleft()
                            if not waiter.cancelled:
                                waiter.cancelled = True
                                reschedule(waiter.task, outcome.Value(replies))
        except _TRANSPORT_ERRORS as exc:
            self._broken(exc, "read failed")
            scope.cancel()


@asynccontextmanager
async def open_connection(
    config: RedisConfig | str,
    *,
    name: str | None = None,
    reconnect: bool = True,
    reply_timeout: float | None = None,
) -> AsyncIterator[Connection]:
    """Connect to Redis and yield a :class:`Connection` for the ``async with`` block.

    Args:
        config: a :class:`RedisConfig` or a URL for :func:`parse_url`.
        name: the client name (``CLIENT SETNAME``), shown by ``CLIENT LIST``.
        reconnect: reconnect in the background when the socket breaks. If false, a
            broken connection stays broken and every call raises
            :class:`MeshConnectionError`.
        reply_timeout: if replies are owed and no byte arrives for this many
            seconds, the socket counts as broken (half-open): in-flight calls
            fail with :class:`MeshConnectionError` and it reconnects. ``None``
            waits as long as TCP does. Do not use with blocking commands.

    Yields:
        The connected :class:`Connection`.

    Raises:
        MeshConnectionError: the first connect failed (within ``connect_timeout``);
            the message names the redacted URL and the OS or Redis error.
        ConfigError: the URL is malformed.

    The connection's trio tasks run in a nursery of this context manager; leaving the
    block (normally, by an exception or by cancellation) closes the connection and
    cancels them. Errors raised in the block come out unwrapped (not in an
    ExceptionGroup).
    """
    config = coerce_config(config)
    stream, reader, _ = await connect(config, name=name)
    conn = Connection(
        config, stream, reader, name=name, reconnect=reconnect, reply_timeout=reply_timeout
    )
    # The connection's trio tasks are shielded from cancellations of the
    # caller's scopes, and stopped only when the block is left: a block
    # cancelled from outside can still use the connection in its shielded
    # clean-up (a worker hands its processes back that way).
    shield = trio.CancelScope(shield=True)

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with shield:
            await conn._run(task_status=task_status)

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            try:
                yield conn
            finally:
                conn._close()
                shield.cancel()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as eg:
        raise_single(eg)
    finally:
        conn._close()
        await trio.aclose_forcefully(conn._stream)
