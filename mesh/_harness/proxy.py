"""A TCP proxy between a worker and Redis that can pass, stall or cut the
traffic, and lose the reply of a chosen command after Redis ran it.

It runs in the test's event loop (trio or asyncio): ``await nursery.start(proxy.run)``, then
point the worker at ``proxy.url``.

* :meth:`stall`: stop forwarding in both directions, on every connection,
  new ones included (a partition: bytes wait, nothing is refused). :meth:`heal`
  delivers what waited and forwards again, as TCP would after a short outage.
* :meth:`cut`: close every connection and refuse new ones (accept, then close
  at once) until :meth:`heal`.
* :meth:`freeze`: every connection open now forwards nothing, ever, and is
  never closed (a half-open connection: the peer vanished without a reset,
  a NAT forgot the flow); new connections pass.
* :meth:`lose_reply_to`: the next command whose words contain ``marker``
  (e.g. the SHA of ``claim.lua``) is forwarded; once Redis's reply to it is
  complete (so it certainly ran), that reply is dropped and the connection
  closed. Commands and replies are counted with ``hiredis`` readers on both
  directions, so "its reply" is exact even with pipelining.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import hiredis

_BUF = 256 * 1024


class _Link:
    def __init__(self) -> None:
        self.scope = anyio.CancelScope()
        self.lose_from: int | None = None  # 1-based number of the marked command
        self.frozen = False
        self.commands = 0

    def close(self) -> None:
        self.scope.cancel()


class Proxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.target_port = target_port
        self.port = 0
        self._flowing = anyio.Event()
        self._flowing.set()
        self._refuse = False
        self._links: set[_Link] = set()
        self._marker: bytes | None = None
        self._lost = anyio.Event()
        self.lost_replies = 0
        self.connections = 0

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    # --- control (sync: no I/O) ---------------------------------------------

    def stall(self) -> None:
        if self._flowing.is_set():
            self._flowing = anyio.Event()

    def freeze(self) -> None:
        for link in self._links:
            link.frozen = True

    def cut(self) -> None:
        self._refuse = True
        for link in list(self._links):
            link.close()

    def heal(self) -> None:
        self._refuse = False
        self._flowing.set()

    def lose_reply_to(self, marker: bytes) -> anyio.Event:
        """Arm: lose the reply of the next command containing ``marker``.
        Returns an event set once a reply was lost."""
        self._marker = marker
        self._lost = anyio.Event()
        return self._lost

    @property
    def stalled(self) -> bool:
        return not self._flowing.is_set()

    # --- serving ------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        async with listener, anyio.create_task_group() as nursery:
            self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
            nursery.start_soon(listener.serve, self._handle)
            task_status.started()

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        if self._refuse:
            await anyio.aclose_forcefully(client)
            return
        try:
            upstream = await anyio.connect_tcp(self.host, self.target_port)
        except OSError:
            await anyio.aclose_forcefully(client)
            return
        link = _Link()
        self._links.add(link)
        self.connections += 1
        try:
            with link.scope:
                async with anyio.create_task_group() as nursery:
                    nursery.start_soon(self._pump, link, client, upstream, self._requests(link))
                    nursery.start_soon(self._pump, link, upstream, client, self._replies(link))
        finally:
            self._links.discard(link)
            await anyio.aclose_forcefully(client)
            await anyio.aclose_forcefully(upstream)

    async def _flow(self, link: _Link) -> None:
        while not self._flowing.is_set() or link.frozen:
            if link.frozen:
                await anyio.sleep_forever()
            await self._flowing.wait()

    async def _pump(self, link: _Link, src: Any, dst: Any, passes: Callable[[bytes], bool]) -> None:
        """Forward what ``src`` receives to ``dst`` while the proxy flows;
        a chunk that ``passes`` refuses is dropped and ends the direction."""
        try:
            while True:
                try:
                    data = await src.receive(_BUF)
                except anyio.EndOfStream:
                    break
                await self._flow(link)
                if not passes(data):
                    break
                await dst.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        link.close()

    def _requests(self, link: _Link) -> Callable[[bytes], bool]:
        """Counts the link's commands, and marks the one that carries the
        marker: its reply and every later one are lost."""
        reader: Any = hiredis.Reader()

        def passes(data: bytes) -> bool:
            nonlocal reader
            if reader is None:
                return True
            try:
                reader.feed(data)
                while (cmd := reader.gets()) is not False:
                    link.commands += 1
                    if (
                        self._marker is not None
                        and link.lose_from is None
                        and isinstance(cmd, list)
                        and any(isinstance(a, bytes) and self._marker in a for a in cmd)
                    ):
                        link.lose_from = link.commands
                        self._marker = None
            except hiredis.ProtocolError:
                reader = None  # not RESP (inline commands): just forward
            return True

        return passes

    def _replies(self, link: _Link) -> Callable[[bytes], bool]:
        """Counts the link's replies; refuses the chunk that completes the
        reply of the marked command."""
        reader: Any = hiredis.Reader()
        replies = 0

        def passes(data: bytes) -> bool:
            nonlocal replies
            try:
                reader.feed(data)
                while reader.gets() is not False:
                    replies += 1
            except hiredis.ProtocolError:  # pragma: no cover - Redis speaks RESP
                pass
            if link.lose_from is not None and replies >= link.lose_from:
                # The marked command ran and its reply is complete: drop it.
                self.lost_replies += 1
                self._lost.set()
                return False
            return True

        return passes
