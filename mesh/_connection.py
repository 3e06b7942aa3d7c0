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

Where to connect is decided by a :class:`~mesh._topology.Topology` on every connect
and reconnect (the URL's node, the master Sentinel names, or the cluster master of
the route key's slot), and the node must say ``ROLE`` master. Error replies that
mean "not executed here" (``MOVED``, ``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``,
``READONLY``, ``LOADING``, ``MASTERDOWN``) are not the caller's: the connection lets
the replies owed on the old socket arrive, re-routes (asks the topology again and
reconnects) and sends those commands again, in their order within a pipeline, for up
to ``reroute_timeout`` seconds; only then the last such error is raised. Two of them
leave the connection where it is, as the Redis Cluster specification says:

* ``ASK slot host:port`` (the key's slot is being migrated and the key is not on this
  node any more): the command alone is sent once to that node, after ``ASKING``, on a
  side connection kept for such redirections; the connection's own node does not
  change. (Inside ``MULTI``/``EXEC`` it is retried like ``TRYAGAIN``.)
* ``TRYAGAIN`` (a multi-key command during a migration, with its keys split between
  the two nodes): sent again after a short backoff, on the same connection.

Replies are RESP2 and never decoded: bulk strings are ``bytes``, integers ``int``,
nil ``None``, arrays ``list``. Error replies become :class:`~mesh.CommandError`.
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import outcome
import trio

from ._errors import ClosedError, CommandError, ConfigError, MeshConnectionError, raise_single
from ._redirect import NOT_HERE, reroute_pause
from ._replicas import wait_replicas
from ._reroute import Redirects, follow_master
from ._shielded import ShieldedTasks
from ._side import SideConnections
from ._topology import Node, Topology
from ._transport import ENCODER as _ENCODER
from ._transport import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
from ._transport import RECEIVE_SIZE as _RECEIVE_SIZE
from ._transport import TRANSPORT_ERRORS as _TRANSPORT_ERRORS
from ._transport import (
    Arg,
    coerce_config,
    connect,
    describe,
    reconnect,
    scrub,
)
from ._transport import make_reader as _make_reader
from ._transport import pack as _pack
from ._url import RedisConfig

# Reads in a row that found data before the reader yields to trio anyway.
_FAIR_READS = 16

__all__ = ["Connection", "ConnectionStatistics", "connect", "open_connection"]

# Re-exported for the contract tests of the sans-IO parts (tests/test_redis_contract.py).
_CONTRACT = (_ENCODER, _make_reader, _pack)


@attrs.frozen
class ConnectionStatistics:
    """A snapshot of a connection's counters, from :meth:`Connection.statistics`.

    Attributes:
        commands_sent: commands written to sockets since the connection was opened.
        writes: socket writes (``send_all`` calls); fewer than ``commands_sent``
            when commands were pipelined.
        reconnects: successful reconnects after a broken socket or a re-route.
        in_flight: commands written and not yet answered.
        reroutes: times a "not executed here" reply (or the pub/sub connection
            finding a new master) made the connection look for the master again.
        asks: commands sent to another node after an ``ASK`` redirection.
        retries: commands sent again in place after ``TRYAGAIN`` (a multi-key
            command during a slot migration).
    """

    commands_sent: int
    writes: int
    reconnects: int
    in_flight: int
    reroutes: int = 0
    asks: int = 0
    retries: int = 0


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
        topology: Topology | None = None,
        node: Node | None = None,
        reroute_timeout: float | None = None,
        direct_writes: bool = False,
    ) -> None:
        self.config = config
        self._direct_writes = direct_writes
        self.topology = topology if topology is not None else Topology(config)
        self._node: Node | None = node
        self._reroute_timeout = (
            config.connect_timeout if reroute_timeout is None else reroute_timeout
        )
        self._rerouting = False
        self._reroute_reason = ""
        self._reroutes = 0
        self._last_reroute = -math.inf
        self._reroute_streak = 0
        self._generation = 0
        self._serve_scope: trio.CancelScope | None = None
        self._name = name
        self._reconnect = reconnect
        self._reply_timeout = reply_timeout
        self._stream = stream
        self._reader = reader
        self._where = config.redacted()
        self._pending: list[_Waiter] = []
        self._in_flight: collections.deque[_Waiter] = collections.deque()
        self._writer_task: trio.lowlevel.Task | None = None
        # The socket's file descriptor while _serve runs on a plain socket
        # stream (TCP or unix; -1: none, TLS, or not direct_writes): _submit
        # writes to it directly when the writer is idle.
        self._fd = -1
        # What a direct write left unsent, for the writer to send first.
        self._unsent: bytes | memoryview = b""
        # A direct write was made since the reader last received data: the
        # next calls go through the writer, which sends them all in one
        # write (many callers in one trio tick still share writes).
        self._wrote = False
        self._connected = True
        self._connected_event = trio.Event()
        self._connected_event.set()
        self._closed = False
        self._last_error = ""
        self._commands_sent = 0
        self._writes = 0
        self._reconnects = 0
        self._in_flight_commands = 0
        self._sides = SideConnections(self.topology, config, name, self._where)
        self._redirects = Redirects(
            self._send, self._request_reroute, self._sides, self._where, self._reroute_timeout
        )

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
            reroutes=self._reroutes,
            asks=self._sides.asks,
            retries=self._redirects.retries,
        )

    @property
    def node(self) -> Node | None:
        """The ``(host, port)`` of the node this connection talks to (None: unix socket)."""
        return self._node

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
        # a cancelled caller raises here, before anything is queued or written
        await trio.lowlevel.checkpoint_if_cancelled()
        waiter = _Waiter(data, 1)
        self._submit(waiter)
        reply = await trio.lowlevel.wait_task_rescheduled(waiter.abort)
        if type(reply) is CommandError:
            if reply.code in NOT_HERE:
                reply = (await self._redirects.resend([args], [reply], self._node))[0]
                if type(reply) is not CommandError:
                    return reply
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
        await trio.lowlevel.checkpoint_if_cancelled()  # as in execute
        waiter = _Waiter(data, len(commands))
        self._submit(waiter)
        replies: list[Any] = await trio.lowlevel.wait_task_rescheduled(waiter.abort)
        if len(commands) == 1:
            replies = [replies]
        for reply in replies:
            if type(reply) is CommandError and reply.code in NOT_HERE:
                replies = await self._redirects.resend(commands, replies, self._node)
                break
        if raise_on_error:
            for i, reply in enumerate(replies):
                if type(reply) is CommandError:
                    reply.add_note(f"(reply {i} of a pipeline of {len(commands)} commands)")
                    raise reply
        return replies

    async def wait_replicas(self, count: int, seconds: float) -> None:
        """Wait until ``count`` replicas acknowledged every write sent on this
        connection so far (``WAIT``, see :mod:`mesh._replicas`; also on the nodes
        that ``ASK`` redirections sent writes to); a no-op for ``count`` 0.

        ``WAIT`` blocks this connection in Redis: commands pipelined behind it
        are answered after it (in the healthy case, a replica's ack takes well
        under a millisecond).

        Raises:
            MeshConnectionError: fewer replicas acknowledged within ``seconds``
                seconds: the writes are on the master, and a failover may lose
                them; or the connection broke.

        On cancellation the ``WAIT`` still runs in Redis; nothing else happens.
        """
        await wait_replicas(self.execute, self._sides, self._where, count, seconds)

    async def aclose(self) -> None:
        """Close the connection. Calls still waiting fail with :class:`ClosedError`,
        later calls raise it. Idempotent. Leaving the ``async with`` block of
        :func:`open_connection` does the same and also stops its trio tasks.

        This is a checkpoint; closing is done even if it is cancelled.
        """
        self._close()
        await trio.lowlevel.checkpoint()

    # ---------------------------------------------------------------- internals

    def _submit(self, waiter: _Waiter) -> None:
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

        The caller is not cancelled (:meth:`execute` and :meth:`pipeline`
        pass ``checkpoint_if_cancelled`` just before, with no checkpoint
        since): a cancelled call must never be sent, and a direct write
        cannot be taken back."""
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
            trio.lowlevel.reschedule(writer)
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
            trio.lowlevel.reschedule(writer)

    async def _send(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """Send ``commands`` back to back once; their replies, errors in place."""
        data: list[bytes | memoryview] = []
        for command in commands:
            data.extend(_pack(command))
        if not self._connected or self._closed:
            await self._wait_connected()
        await trio.lowlevel.checkpoint_if_cancelled()  # as in execute
        waiter = _Waiter(data, len(commands))
        self._submit(waiter)
        replies = await trio.lowlevel.wait_task_rescheduled(waiter.abort)
        return [replies] if len(commands) == 1 else list(replies)

    def _request_reroute(self, reason: str) -> None:
        """Stop writing to this node; once every owed reply has arrived, close the
        socket and let :meth:`_run` ask the topology where the master is now."""
        if self._rerouting or self._closed or not self._connected:
            return
        self._rerouting = True
        self._reroute_reason = scrub(reason, self.config)
        self._reroutes += 1
        if not self._in_flight and self._serve_scope is not None:
            self._serve_scope.cancel()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sides.closed = True
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
            if self._rerouting and self._connected and not self._closed:
                if self._reconnect:
                    # Commands not yet written wait for the new socket (bounded below).
                    self._connected = False
                    self._connected_event = trio.Event()
                    self._last_error = f"re-routing: {self._reroute_reason}"
                    _fail_waiters(self._in_flight, self._lost_error)
                    self._in_flight_commands = 0
                    now = trio.current_time()
                    self._reroute_streak, pause = reroute_pause(
                        self._reroute_streak, self._last_reroute, now
                    )
                    self._last_reroute = now
                    await trio.sleep(pause)
                else:
                    self._broken(None, f"re-routing needed ({self._reroute_reason})")
            if self._closed or not self._reconnect:
                # Stay broken: calls raise MeshConnectionError / ClosedError.
                await trio.sleep_forever()
            with trio.move_on_after(self.config.connect_timeout) as waited:
                stream, reader, node = await self._reconnect_with_backoff()
            if waited.cancelled_caught:
                # Unsent commands kept through a re-route must not wait forever.
                _fail_waiters(self._pending, self._not_back_error)
                stream, reader, node = await self._reconnect_with_backoff()
            self._stream, self._reader, self._node = stream, reader, node
            await self._sides.aclose()  # a migration's side connections are done with
            self._in_flight = collections.deque()
            self._pending = [w for w in self._pending if not w.cancelled]
            self._rerouting = False
            self._generation += 1
            self._connected = True
            self._reconnects += 1
            self._connected_event.set()

    def _lost_error(self) -> MeshConnectionError:
        return MeshConnectionError(
            f"connection to {self._where} re-routed while the command was in flight "
            f"(it may or may not have run): {self._reroute_reason}"
        )

    def _not_back_error(self) -> MeshConnectionError:
        return MeshConnectionError(
            f"not connected to {self._where}: no master reached within connect_timeout="
            f"{self.config.connect_timeout:g}s (last error: {self._last_error})"
        )

    async def _reconnect_with_backoff(self) -> tuple[trio.abc.Stream, Any, Node]:
        async def attempt() -> tuple[trio.abc.Stream, Any, Node]:
            stream, reader, _, node = await self.topology.connect(name=self._name)
            return stream, reader, node

        def failed(message: str) -> None:
            self._last_error = message

        return await reconnect(attempt, failed, self.topology.reached)

    async def _serve(self, stream: trio.abc.Stream, reader: Any) -> None:
        """Run the reader and the writer on one stream until it breaks."""
        try:
            async with trio.open_nursery() as nursery:
                self._serve_scope = nursery.cancel_scope
                self._fd = _plain_fd(stream) if self._direct_writes else -1
                self._unsent = b""
                if self._rerouting and not self._in_flight:
                    nursery.cancel_scope.cancel()
                nursery.start_soon(self._read_loop, stream, reader, nursery.cancel_scope)
                nursery.start_soon(self._write_loop, stream, nursery.cancel_scope)
                nursery.start_soon(
                    follow_master,
                    self.topology,
                    self.config,
                    self._node,
                    self._reroute_timeout,
                    self._request_reroute,
                )
        finally:
            self._serve_scope = None
            self._fd = -1
            self._unsent = b""
            await trio.aclose_forcefully(stream)

    async def _write_loop(self, stream: trio.abc.Stream, scope: trio.CancelScope) -> None:
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
        timed = timeout < math.inf  # else ``last`` is never looked at again
        # On a plain socket, read it directly: a read that finds data does
        # not yield to trio (trio's receive_some does, after each), one that
        # finds none waits until it is readable. Every _FAIR_READS reads in a
        # row without waiting, it yields anyway, so a flood of replies does
        # not starve the other trio tasks.
        # When the data read so far answered every call in flight, the next
        # read would find nothing (the callers have not even run yet): wait
        # until the socket is readable first, rather than fail a read.
        fd = _plain_fd(stream)
        read = os.read
        streak = 0
        wait_first = False
        try:
            while True:
                with trio.CancelScope(deadline=last + timeout) as waited:
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
                                await trio.lowlevel.checkpoint()
                        if timed:
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
                        if not in_flight:
                            if self._rerouting:
                                scope.cancel()  # every owed reply arrived: re-route now
                                return
                            wait_first = True
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


def _plain_fd(stream: trio.abc.Stream) -> int:
    """The file descriptor of a plain socket stream (TCP or unix), which the
    connection reads and writes directly; -1 for any other stream (TLS)."""
    if type(stream) is trio.SocketStream:
        return stream.socket.fileno()
    return -1


@asynccontextmanager
async def open_connection(
    config: RedisConfig | str,
    *,
    name: str | None = None,
    reconnect: bool = True,
    reply_timeout: float | None = None,
    route_key: bytes | str | None = None,
    topology: Topology | None = None,
    reroute_timeout: float | None = None,
    direct_writes: bool = False,
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
        route_key: on a Redis Cluster, connect to the master serving this key's hash
            slot (a namespace's keys share the slot of ``{ns}:``). Default: slot 0.
        topology: share the master discovery with a pub/sub connection
            (:class:`~mesh._topology.Topology`), so that both stay on one node;
            default: a new one for ``config`` and ``route_key``.
        reroute_timeout: for how long commands answered "not executed here"
            (``MOVED``, ``READONLY``, ``TRYAGAIN``... see the module docstring) are
            re-routed and re-sent before the error is raised; default
            ``connect_timeout``.
        direct_writes: on a plain socket (not TLS), a call made while the
            writer is idle writes its commands at once, from the calling trio
            task, instead of waking the writer (one trio task switch less
            per round trip; see :meth:`Connection._submit`). The command then
            leaves before any other trio task runs: a caller that resumes
            from a long block (a frozen process) sends it before its timers
            run, so this is for connections whose writes Redis fences (the
            worker's), not for reports to a system that relies on the
            caller's cancellation to stop a stale write.

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
    if topology is None:
        topology = Topology(config, route_key)
    if reroute_timeout is not None and not reroute_timeout >= 0:
        raise ConfigError(f"reroute_timeout must be >= 0 seconds, not {reroute_timeout!r}")
    stream, reader, _, node = await topology.connect(name=name)
    conn = Connection(
        config,
        stream,
        reader,
        name=name,
        reconnect=reconnect,
        reply_timeout=reply_timeout,
        topology=topology,
        node=node,
        reroute_timeout=reroute_timeout,
        direct_writes=direct_writes,
    )
    try:
        async with trio.open_nursery() as nursery:
            # The connection's trio tasks are shielded from cancellations of
            # the caller's scopes, and stopped only when the block is left: a
            # block cancelled from outside can still use the connection in its
            # shielded clean-up (a worker hands its processes back that way).
            tasks = ShieldedTasks(nursery)
            try:
                await tasks.start(conn._run)
                watch = topology.failover
                if watch is not None and not watch.running:
                    # One watch per topology: the pub/sub connection sharing
                    # it reads the same announcements.
                    sentinels = topology.sentinel_configs()
                    tasks.start_soon(lambda: watch.run(sentinels))
                yield conn
            finally:
                conn._close()
                tasks.cancel()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as eg:
        raise_single(eg)
    finally:
        conn._close()
        await trio.aclose_forcefully(conn._stream)
        await conn._sides.aclose()
