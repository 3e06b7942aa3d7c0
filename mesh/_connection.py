"""The trio-native Redis connection: trio streams, hiredis, auto-pipelining, reconnect.

:class:`Connection` is what the rest of mesh calls: :meth:`~Connection.execute`,
:meth:`~Connection.pipeline`, :meth:`~Connection.wait_replicas`. Its parts, each in
its own module beneath it:

* :mod:`mesh._wire`: the reply loop. :meth:`Connection.execute` packs its command
  (RESP2, with redis-py's ``Encoder`` for unusual argument types) and parks its
  trio task; one writer trio task writes everything pending in one ``send_all``
  (auto-pipelining), one reader trio task hands each reply to the oldest caller in
  flight (Redis answers in order). A cancelled caller's command is dropped if not
  yet written, else its reply is swallowed.
* :mod:`mesh._redirect` (rules, no I/O) and :mod:`mesh._reroute` (their I/O):
  error replies that mean "not executed here" (``MOVED``, ``ASK``, ``TRYAGAIN``,
  ``CLUSTERDOWN``, ``READONLY``, ``LOADING``, ``MASTERDOWN``) are not the
  caller's: the connection lets the replies owed on the old socket arrive,
  re-routes (asks the topology again and reconnects) and sends those commands
  again, in their order within a pipeline, for up to ``reroute_timeout`` seconds;
  only then the last such error is raised. ``ASK`` (the command alone, once, after
  ``ASKING``, to the node importing the slot) and ``TRYAGAIN`` (again after a short
  backoff) leave the connection where it is, as the Redis Cluster specification
  says; inside ``MULTI``/``EXEC``, ``ASK`` is retried like ``TRYAGAIN``.
* :mod:`mesh._side`: the side connections to ``ASK`` targets.
* :mod:`mesh._replicas`: ``WAIT`` for ``min_replicas``, here and on those nodes.

When the socket breaks, every in-flight and pending command fails with
:class:`~mesh.MeshConnectionError` (for commands that were written, it is unknown
whether Redis ran them), and a background trio task reconnects with exponential
backoff and jitter. Calls made meanwhile wait up to ``connect_timeout`` for the
reconnect. Where to connect is decided by a :class:`~mesh._topology.Topology` on
every connect and reconnect (the URL's node, the master Sentinel names, or the
cluster master of the route key's slot), and the node must say ``ROLE`` master.

Replies are RESP2 and never decoded: bulk strings are ``bytes``, integers ``int``,
nil ``None``, arrays ``list``. Error replies become :class:`~mesh.CommandError`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import attrs

from ._errors import CommandError, ConfigError, MeshConnectionError, raise_single
from ._loop import ByteStream, aclose_forcefully
from ._reconnect import reconnect
from ._redirect import NOT_HERE, reroute_pause
from ._replicas import wait_replicas
from ._reroute import Redirects, follow_master
from ._shielded import ShieldedTasks
from ._side import SideConnections
from ._topology import Node, Topology
from ._transport import ENCODER as _ENCODER
from ._transport import Arg, connect, scrub
from ._transport import make_reader as _make_reader
from ._transport import pack as _pack
from ._url import RedisConfig, coerce_config
from ._wire import Waiter, Wire, fail_waiters

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


class Connection(Wire):
    """One Redis connection shared by any number of trio tasks. Get one from
    :func:`open_connection`.

    Concurrent calls are pipelined automatically: what is queued while a write is in
    progress goes out in the next single write (:mod:`mesh._wire` moves the bytes).
    """

    def __init__(
        self,
        config: RedisConfig,
        stream: ByteStream,
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
        super().__init__(
            config,
            stream,
            reader,
            reconnect=reconnect,
            reply_timeout=reply_timeout,
            direct_writes=direct_writes,
        )
        self.topology = topology if topology is not None else Topology(config)
        self._node: Node | None = node
        self._name = name
        self._reroute_timeout = (
            config.connect_timeout if reroute_timeout is None else reroute_timeout
        )
        self._reroute_reason = ""
        self._reroutes = 0
        self._last_reroute = -math.inf
        self._reroute_streak = 0
        self._generation = 0
        self._reconnects = 0
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
        await self._loop.checkpoint_if_cancelled()
        waiter = Waiter(data, 1, self._handle())
        self._submit(waiter)
        reply = await self._park(waiter.task, waiter.abort)
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
            await anyio.lowlevel.checkpoint()
            return []
        replies = await self._send(commands)
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
        await anyio.lowlevel.checkpoint()

    # ---------------------------------------------------------------- internals

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

    async def _run(
        self, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """The connection's supervisor trio task: serve, and reconnect when broken."""
        task_status.started()
        while True:
            await self._serve(self._stream, self._reader, self._follow_master)
            if self._rerouting and self._connected and not self._closed:
                if self._reconnect:
                    # Commands not yet written wait for the new socket (bounded below).
                    self._connected = False
                    self._connected_event = anyio.Event()
                    self._last_error = f"re-routing: {self._reroute_reason}"
                    fail_waiters(self._in_flight, self._lost_error, self._wake)
                    self._in_flight_commands = 0
                    now = anyio.current_time()
                    self._reroute_streak, pause = reroute_pause(
                        self._reroute_streak, self._last_reroute, now
                    )
                    self._last_reroute = now
                    await anyio.sleep(pause)
                else:
                    self._broken(None, f"re-routing needed ({self._reroute_reason})")
            if self._closed or not self._reconnect:
                # Stay broken: calls raise MeshConnectionError / ClosedError.
                await anyio.sleep_forever()
            with anyio.move_on_after(self.config.connect_timeout) as waited:
                stream, reader, node = await self._reconnect_with_backoff()
            if waited.cancelled_caught:
                # Unsent commands kept through a re-route must not wait forever.
                fail_waiters(self._pending, self._not_back_error, self._wake)
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

    def _close(self) -> None:
        self._sides.closed = True
        super()._close()

    async def _follow_master(self) -> None:
        """Re-route when the master changed (:func:`~mesh._reroute.follow_master`)."""
        await follow_master(
            self.topology, self.config, self._node, self._reroute_timeout, self._request_reroute
        )

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

    async def _reconnect_with_backoff(self) -> tuple[ByteStream, Any, Node]:
        async def attempt() -> tuple[ByteStream, Any, Node]:
            stream, reader, _, node = await self.topology.connect(name=self._name)
            return stream, reader, node

        def failed(message: str) -> None:
            self._last_error = message

        return await reconnect(attempt, failed, self.topology.reached)


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
        async with anyio.create_task_group() as nursery:
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
        await aclose_forcefully(conn._stream)
        await conn._sides.aclose()
