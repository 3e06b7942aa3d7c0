"""A Redis connection's bytes on asyncio: an ``asyncio.Protocol`` with trio's
stream methods, and a fast mode for the command connection's hot path.

On trio the connection reads and writes a socket's file descriptor itself
(:mod:`mesh._wire`). On asyncio the loop owns the socket, and its cheapest
way in and out is a protocol: the loop calls :meth:`AsyncioStream.data_received`
with what arrived, and ``transport.write`` never blocks (it buffers). So:

* the handshake, pub/sub and the side connections use it like trio's stream
  (:meth:`send_all`, :meth:`receive_some`, :meth:`aclose`);
* the command connection hands it a *consumer* (:meth:`consume`): received
  bytes go straight to the reply matching, with no reader task and no future
  per read, and commands are written at once from the calling task
  (:meth:`write`), with no writer task: one task switch per round trip (the
  caller's) instead of three.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import cast

import anyio
import anyio.lowlevel

__all__ = ["AsyncioStream", "open_asyncio_stream"]


class AsyncioStream(asyncio.Protocol):
    """One connection's protocol and stream (see the module docstring).

    ``receive_some`` answers ``b""`` at the end of the stream and raises
    ``anyio.BrokenResourceError`` when the connection was lost with an
    error; ``send_all`` raises it when the transport is closed.
    """

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False  # the end of the stream, or lost
        self._error: BaseException | None = None
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self._consumer: Callable[[bytes], None] | None = None
        self._on_lost: Callable[[BaseException | None], None] | None = None

    # --- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # an asyncio.Transport, or uvloop's (which is not a subclass of it)
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        consumer = self._consumer
        if consumer is not None:
            consumer(data)
            return
        self._buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self._lost(None)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)
        self._wake_drain()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drain()

    # --- the stream -------------------------------------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.write(data)
        if self._paused:
            loop = asyncio.get_running_loop()
            self._drained = drained = loop.create_future()
            await drained

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        while not self._buffer:
            if self._closed:
                if self._error is not None:
                    raise anyio.BrokenResourceError(str(self._error)) from self._error
                return b""
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        if max_bytes is None or max_bytes >= len(self._buffer):
            data = bytes(self._buffer)
            self._buffer.clear()
        else:
            data = bytes(self._buffer[:max_bytes])
            del self._buffer[:max_bytes]
        return data

    async def aclose(self) -> None:
        self.abort()
        await anyio.lowlevel.checkpoint()

    # --- the command connection's fast mode -------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` now (sync; the transport buffers what the socket
        does not take yet).

        Raises:
            anyio.BrokenResourceError: the connection is closed or lost.
        """
        transport = self._transport
        if transport is None or transport.is_closing():
            raise anyio.BrokenResourceError("the connection is closed")
        transport.write(data)

    def consume(
        self,
        consumer: Callable[[bytes], None] | None,
        on_lost: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        """From now on, hand what arrives to ``consumer`` (what was buffered
        first), and tell ``on_lost`` when the connection ends (``None`` for
        an end of stream, else the error); ``None`` ends the fast mode."""
        self._consumer = consumer
        self._on_lost = on_lost
        if consumer is not None and self._buffer:
            data = bytes(self._buffer)
            self._buffer.clear()
            consumer(data)
        if on_lost is not None and self._closed:
            on_lost(self._error)

    def abort(self) -> None:
        """Close at once, without flushing (as ``trio.aclose_forcefully``)."""
        if self._transport is not None:
            self._transport.abort()

    # --- internals -----------------------------------------------------------------

    def _lost(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._error = exc
        self._wake()
        if self._on_lost is not None:
            self._on_lost(exc)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_drain(self) -> None:
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)
        self._drained = None


async def open_asyncio_stream(
    host: str | None, port: int, path: str | None, context: ssl.SSLContext | None
) -> AsyncioStream:
    """Connect (TCP, or a unix socket at ``path``; TLS when ``context`` is
    given) on the running asyncio loop.

    Raises:
        OSError: the connection failed (refused, unreachable, TLS).
    """
    loop = asyncio.get_running_loop()
    if path is not None:
        _, stream = await loop.create_unix_connection(AsyncioStream, path, ssl=context)
    else:
        assert host is not None
        _, stream = await loop.create_connection(
            AsyncioStream, host, port, ssl=context, server_hostname=host if context else None
        )
    return stream
