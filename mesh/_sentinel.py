"""Redis Sentinel: which node the sentinels name as master, and following it.

For a ``redis+sentinel://`` URL, :class:`Sentinel` asks each sentinel in turn
``SENTINEL GET-MASTER-ADDR-BY-NAME``; the first answer wins. While the sentinels
announce a failover (:mod:`mesh._failover`, watched by the command connection),
the old master is not used: the replica is taken as soon as its promotion is
announced, and after a switch a sentinel still naming the old master is not
believed. The node reached must say ``master`` to ``ROLE`` (a user whose ACL
forbids ``ROLE`` is refused here), and hold the namespace's epoch.

Errors: every failure is a :class:`~mesh.MeshConnectionError` (the reconnect loop
tries again); messages name redacted addresses only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import anyio
import attrs

from ._errors import MeshConnectionError
from ._failover import FailoverWatch
from ._loop import ByteStream, aclose_forcefully
from ._probe import Finder, Found, Node, Nodes, decode, role_name
from ._transport import TRANSPORT_ERRORS, Arg, connect, next_reply, pack, scrub
from ._url import RedisConfig

__all__ = ["FAILOVER_HOLD", "Sentinel"]

# The longest a connection keeps off a master being failed over (from +odown or
# +try-failover) when no announcement ends the failover first (the switch, an
# abort, -odown). Writing there instead would be worse: the old master takes
# writes, lease renewals included, that its demotion drops. Holding is safe for
# a worker: its handlers stop at R without a confirmed renewal, as in any outage.
FAILOVER_HOLD: Final = 5.0


class Sentinel(Finder):
    """The master of a ``redis+sentinel://`` URL's service, as the sentinels name it."""

    failover: FailoverWatch
    takes_over = True

    def __init__(self, nodes: Nodes) -> None:
        super().__init__(nodes)
        config = nodes.config
        self._command = ("SENTINEL", "GET-MASTER-ADDR-BY-NAME", config.service or "")
        # The failover announcements, once a connection runs the watch
        # (FailoverWatch.run); connections keep off a master that is being
        # failed over for at most ``hold`` (see mesh._failover).
        self.failover = FailoverWatch(config.service or "", FAILOVER_HOLD)
        # The sentinel that last told a connection the master had moved.
        self._preferred: Node | None = None

    async def find(self, name: str | None, extra: Sequence[Sequence[Arg]]) -> Found:
        """While a failover is announced (:mod:`mesh._failover`), keep off the
        old master and take the replica as soon as its promotion is announced
        (bounded by the watch's hold); otherwise the master the sentinels name,
        unless a switch was announced away from it."""
        watch = self.failover
        if watch.running:
            while watch.in_progress(anyio.current_time()):
                promoted = watch.promoted
                if promoted is not None and promoted != watch.old:
                    try:
                        return await self._open_master(promoted, extra, name, "was promoted")
                    except MeshConnectionError:
                        pass  # not promoted yet: try again shortly
                with anyio.CancelScope(
                    deadline=min(watch.hold_until(), anyio.current_time() + 0.02)
                ):
                    await watch.wait_changed()
        target = await self._ask()
        new = watch.replaced(target)
        if new is not None:
            try:
                return await self._open_master(new, extra, name, "was switched to")
            except MeshConnectionError:
                watch.forget_switch()  # a later failover we missed: ask again
                target = await self._ask()
        return await self._open_master(target, extra, name, "is named")

    def sentinel_configs(self) -> list[RedisConfig]:
        """The configuration of each sentinel of the URL."""
        return [self._config(node) for node in self.nodes.config.nodes]

    async def _open_master(
        self, target: Node, extra: Sequence[Sequence[Arg]], name: str | None, why: str
    ) -> Found:
        """Connect to ``target`` and keep it only if ``ROLE`` says master."""
        nodes = self.nodes
        stream, reader, replies, probe = await nodes.open(target, extra, name, cluster=False)
        if probe.role is None:
            await aclose_forcefully(stream)
            raise MeshConnectionError(
                f"the user may not run ROLE on {nodes.show(target)}: trio-mesh needs it "
                "on Sentinel to refuse a node that is not the master"
            )
        if probe.role != b"master":
            await aclose_forcefully(stream)
            raise MeshConnectionError(
                f"{nodes.show(target)} {why} master of {nodes.config.service!r} by Sentinel, "
                f"but it says it is a {role_name(probe)}; waiting for Sentinel to catch up"
            )
        await nodes.judge_epoch(probe, target, stream)
        nodes.arrived(target)
        return stream, reader, replies, target

    async def wait_left(self, node: Node, interval: float) -> str:
        """Return why the master is no longer ``node``, once it is not: the other
        connection found a new one, the sentinels (asked every ``interval``
        seconds) name another, or they announce a failover of ``node``."""
        reason = ""
        async with anyio.create_task_group() as nursery:

            def found(why: str) -> None:
                nonlocal reason
                reason = why
                nursery.cancel_scope.cancel()

            async def watch() -> None:
                named = await self.watch(node, interval)
                found(f"Sentinel names {named[0]}:{named[1]} as master now")

            async def moved() -> None:
                await self.nodes.wait_moved(node)
                found(f"the master moved to {self.nodes.master}")

            async def announced() -> None:
                failover = self.failover
                while not failover.leaving(node, anyio.current_time()):
                    await failover.wait_changed()
                # Hold the writes now: the old master takes them until it
                # is demoted, seconds after the replica was promoted.
                found(f"Sentinel is failing over {node[0]}:{node[1]}")

            nursery.start_soon(watch)
            nursery.start_soon(moved)
            nursery.start_soon(announced)
        return reason

    async def watch(self, node: Node, interval: float) -> Node:
        """Ask the sentinels every ``interval`` seconds which node is the master, on
        one connection kept open (the next sentinel in the list when one fails),
        and return the master they name once it is not ``node``.

        A failover that leaves the old master reachable (``SENTINEL FAILOVER``, a
        partition that heals) does not break a connection to it: the old master
        takes writes until Sentinel reconfigures it as a replica, seconds later.
        A connection that watches the sentinels leaves it within ``interval``.

        Errors of one round (no sentinel answers) are ignored: the next round
        tries again. Cancellation closes the sentinel connection.
        """
        sentinels = list(self.nodes.config.nodes)
        stream: ByteStream | None = None
        reader: Any = None
        try:
            while True:
                await anyio.sleep(interval)
                for _ in range(len(sentinels)):
                    try:
                        with anyio.fail_after(self.nodes.config.connect_timeout):
                            if stream is None:
                                one = self._config(sentinels[0])
                                stream, reader, replies = await connect(one, extra=[self._command])
                                reply = replies[0]
                            else:
                                await stream.send_all(b"".join(pack(self._command)))
                                reply = await next_reply(stream, reader)
                    except (MeshConnectionError, TimeoutError, *TRANSPORT_ERRORS):
                        if stream is not None:
                            await aclose_forcefully(stream)
                            stream = None
                        sentinels.append(sentinels.pop(0))  # the next one, next time
                        continue
                    if isinstance(reply, list) and len(reply) == 2:
                        named = (decode(reply[0]), int(reply[1]))
                        if self.failover.replaced(named) == node:
                            break  # a sentinel that has not caught up with the switch
                        if named != node:
                            # Ask this sentinel first on the reconnect: another
                            # one may not have heard of the failover yet.
                            self._preferred = sentinels[0]
                            return named
                    break
        finally:
            if stream is not None:
                await aclose_forcefully(stream)

    def _config(self, sentinel: Node) -> RedisConfig:
        config = self.nodes.config
        return attrs.evolve(
            config,
            host=sentinel[0],
            port=sentinel[1],
            db=0,
            username=config.sentinel_username,
            password=config.sentinel_password,
            topology="standalone",
            nodes=(),
        )

    async def _ask(self) -> Node:
        """The master the first sentinel that answers names (the preferred one first)."""
        config = self.nodes.config
        errors: list[str] = []
        sentinels = list(config.nodes)
        if self._preferred in sentinels:
            sentinels.remove(self._preferred)
            sentinels.insert(0, self._preferred)
        for sentinel in sentinels:
            try:
                stream, _, replies = await connect(self._config(sentinel), extra=[self._command])
            except MeshConnectionError as exc:
                errors.append(str(exc))
                if sentinel == self._preferred:
                    self._preferred = None  # back to the URL's order
                continue
            await aclose_forcefully(stream)
            reply = replies[0]
            if isinstance(reply, list) and len(reply) == 2:
                return decode(reply[0]), int(reply[1])
            where = self.nodes.show(sentinel)
            if reply is None:
                errors.append(f"sentinel {where} does not know the master {config.service!r}")
            else:
                errors.append(f"sentinel {where} answered {reply!r:.100}")
        raise MeshConnectionError(scrub("no sentinel named a master: " + "; ".join(errors), config))
