"""The trio-native Redis connection: trio streams, hiredis, auto-pipelining, reconnect.

How it moves bytes:

* :meth:`Connection.execute` packs its command (:func:`_pack`: RESP2, with
  redis-py's ``Encoder`` for unusual argument types), appends a small waiter to
  the *pending* list, wakes the writer if it sleeps, and parks its trio task
  until the reply arrives.
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
import random
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, TypeAlias

import attrs
import hiredis
import outcome
import trio
from redis._parsers import Encoder
from redis.exceptions import DataError

from ._errors import ClosedError, CommandError, ConfigError, MeshConnectionError, raise_single
from ._url import RedisConfig, parse_url

__all__ = ["Connection", "ConnectionStatistics", "connect", "open_connection"]

Arg: TypeAlias = bytes | str | int | float

# Transport failures we translate to MeshConnectionError at the boundary.
_TRANSPORT_ERRORS: Final = (
    OSError,
    trio.BrokenResourceError,
    ssl.SSLError,
    hiredis.ProtocolError,
)
_RECEIVE_SIZE: Final = 256 * 1024
_BACKOFF_START: Final = 0.02
_BACKOFF_CAP: Final = 1.0
# Not a possible reply: RESP2 has no booleans, so hiredis' "no complete reply yet"
# marker is a private object.
_NOT_ENOUGH_DATA: Final = object()


def _reply_error(message: str) -> CommandError:
    """hiredis' ``replyError`` callback: an error reply becomes a CommandError
    (also inside arrays, e.g. in the reply of ``EXEC``)."""
    return CommandError(message, code=message.split(" ", 1)[0])


def _make_reader() -> Any:
    return hiredis.Reader(replyError=_reply_error, notEnoughData=_NOT_ENOUGH_DATA)


# Packing: RESP2 arrays of bulk strings, written here for the common argument
# types (a busy runner's script call has about 40 arguments, and redis-py's
# general serializer took twice as long). Anything else goes through redis-py's
# Encoder, which also decides what is refused (bool, None, other objects).
_ENCODER: Final = Encoder(  # type: ignore[no-untyped-call]
    encoding="utf-8", encoding_errors="strict", decode_responses=False
)


def _pack(args: Sequence[Arg]) -> list[bytes | memoryview]:
    """Pack one command into a list of bytes for the writer to join (a large
    ``bytes`` argument is not copied here): ``str`` as UTF-8, ``int`` and
    ``float`` as their ``repr``, ``bytes`` and ``memoryview`` as they are; a
    first argument with spaces (``"CLIENT KILL"``) is split into words. An
    argument of an unsupported type is a ConfigError (nothing is sent)."""
    if not args:
        raise ConfigError("a Redis command needs at least its name")
    first = args[0]
    if type(first) is str:
        if " " in first:
            args = (*first.encode().split(), *args[1:])
    elif isinstance(first, bytes) and b" " in first:
        args = (*first.split(), *args[1:])
    out: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
    append = out.append
    b: bytes | memoryview
    for a in args:
        if isinstance(a, bytes):
            b = a
        elif isinstance(a, str):
            b = a.encode()
        elif type(a) is int:
            b = b"%d" % a
        else:
            try:
                b = _ENCODER.encode(a)  # type: ignore[no-untyped-call]
            except DataError as exc:
                raise ConfigError(f"cannot send this argument to Redis: {exc}") from None
        append(b"$%d\r\n" % len(b))
        append(b)
        append(b"\r\n")
    return out


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


def _describe(exc: BaseException) -> str:
    """A one-line description of a transport error, including the OS error behind a
    trio wrapper and the individual attempts of ``open_tcp_stream``."""
    parts = [str(exc) or type(exc).__name__]
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, BaseExceptionGroup):
        subs = {str(e) for e in cause.exceptions}
        parts.append("; ".join(sorted(subs)))
    elif cause is not None and str(cause) and str(cause) not in parts[0]:
        parts.append(str(cause))
    return ": ".join(parts)


def _ssl_context(config: RedisConfig) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=config.tls_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load the CA file {config.tls_ca_file!r} for {config.redacted()}: {exc}"
        ) from exc
    if not config.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _scrub(text: str, config: RedisConfig) -> str:
    """Belt and braces: no message we build may contain the password."""
    if config.password:
        text = text.replace(config.password, "***")
    return text


async def _read_replies(stream: trio.abc.Stream, reader: Any, count: int) -> list[Any]:
    """Read exactly ``count`` replies (used by the handshake, before the reader task runs)."""
    replies: list[Any] = []
    while len(replies) < count:
        reply = reader.gets()
        if reply is _NOT_ENOUGH_DATA:
            data = await stream.receive_some(_RECEIVE_SIZE)
            if not data:
                raise trio.BrokenResourceError("Redis closed the connection")
            reader.feed(data)
        else:
            replies.append(reply)
    return replies


async def connect(
    config: RedisConfig,
    *,
    name: str | None = None,
    extra: Sequence[Sequence[Arg]] = (),
) -> tuple[trio.abc.Stream, Any, list[Any]]:
    """Open a stream to Redis and authenticate, select the db and set the client name.

    Shared by :class:`Connection` and the pub/sub connection. The whole of it (TCP or
    unix connect, TLS handshake, ``AUTH``/``SELECT``/``CLIENT SETNAME``) is bounded by
    ``config.connect_timeout``.

    Args:
        config: where to connect.
        name: sent with ``CLIENT SETNAME`` if given.
        extra: more commands to send after the handshake; their replies (error
            replies included, as CommandError values) are returned.

    Returns:
        The stream, the ``hiredis.Reader`` already fed with what was read, and the
        replies of ``extra``.

    Raises:
        MeshConnectionError: connecting, the TLS handshake or authentication failed,
            or it took longer than ``connect_timeout``. The message names the redacted
            URL and the cause; it never contains the password.
        ConfigError: the CA file cannot be loaded.

    On cancellation the half-open stream is closed and nothing is left behind.
    """
    where = config.redacted()
    handshake: list[Sequence[Arg]] = []
    if config.password is not None:
        if config.username is not None:
            handshake.append(("AUTH", config.username, config.password))
        else:
            handshake.append(("AUTH", config.password))
    if config.db:
        handshake.append(("SELECT", config.db))
    if name is not None:
        handshake.append(("CLIENT", "SETNAME", name))
    context = _ssl_context(config) if config.tls else None
    stream: trio.abc.Stream | None = None
    try:
        with trio.fail_after(config.connect_timeout):
            if config.path is not None:
                stream = await trio.open_unix_socket(config.path)
            else:
                stream = await trio.open_tcp_stream(config.host, config.port)
            if context is not None:
                stream = trio.SSLStream(stream, context, server_hostname=config.host)
                await stream.do_handshake()
            reader = _make_reader()
            commands = [*handshake, *extra]
            replies: list[Any] = []
            if commands:
                await stream.send_all(b"".join(b"".join(_pack(c)) for c in commands))
                replies = await _read_replies(stream, reader, len(commands))
    except trio.TooSlowError:
        if stream is not None:
            await trio.aclose_forcefully(stream)
        raise MeshConnectionError(
            f"could not connect to {where} within connect_timeout={config.connect_timeout:g}s"
        ) from None
    except _TRANSPORT_ERRORS as exc:
        if stream is not None:
            await trio.aclose_forcefully(stream)
        raise MeshConnectionError(
            _scrub(f"could not connect to {where}: {_describe(exc)}", config)
        ) from exc
    except BaseException:
        if stream is not None:
            await trio.aclose_forcefully(stream)
        raise
    for command, reply in zip(handshake, replies, strict=False):
        if isinstance(reply, CommandError):
            await trio.aclose_forcefully(stream)
            step = str(command[0]) if command[0] != "CLIENT" else "CLIENT SETNAME"
            raise MeshConnectionError(
                _scrub(f"{step} failed on {where}: {reply}", config)
            ) from reply
    return stream, reader, replies[len(handshake) :]


def _backoff_delays() -> collections.abc.Iterator[float]:
    """Exponential backoff with jitter: each delay is uniform in [d/2, d], d going
    from 20 ms, doubling, to a 1 s cap."""
    delay = _BACKOFF_START
    while True:
        yield delay / 2 + random.random() * delay / 2
        delay = min(delay * 2, _BACKOFF_CAP)


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
        detail = _scrub(reason if exc is None else f"{reason}: {_describe(exc)}", self.config)
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
        for delay in _backoff_delays():
            await trio.sleep(delay)
            try:
                stream, reader, _ = await connect(self.config, name=self._name)
            except MeshConnectionError as exc:
                self._last_error = str(exc)
                continue
            return stream, reader
        raise AssertionError("unreachable")  # pragma: no cover

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
        timeout = self._reply_timeout or math.inf
        current_time = trio.current_time
        # One cancel scope per reply_timeout period, not per receive: its
        # deadline is when the last data arrived (or the wait began) plus
        # reply_timeout; when it passes, the loop looks at what really came.
        last = current_time()
        try:
            while True:
                with trio.CancelScope(deadline=last + timeout) as waited:
                    while True:
                        data = await stream.receive_some(_RECEIVE_SIZE)
                        last = current_time()
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
                                self._broken(
                                    None, f"protocol error: unexpected reply {reply!r:.100}"
                                )
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
                if waited.cancelled_caught:
                    now = current_time()
                    if not in_flight:
                        last = now  # idle: nothing is owed
                        continue
                    if now - last < timeout:
                        continue  # data came meanwhile: wait from then
                    # Replies are owed and nothing came: a half-open socket
                    # (the peer host vanished, a NAT forgot the flow). Break it
                    # so the connection reconnects instead of waiting for TCP.
                    self._broken(None, f"no reply within reply_timeout={self._reply_timeout:g}s")
                    scope.cancel()
                    return
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
    if isinstance(config, str):
        config = parse_url(config)
    elif not isinstance(config, RedisConfig):
        raise ConfigError(f"expected a RedisConfig or a URL, not {type(config).__name__}")
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
