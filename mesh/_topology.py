"""Where is the master now: standalone, Sentinel and Cluster discovery, under the connection.

A :class:`Topology` is asked on every connect and reconnect of a
:class:`~mesh._connection.Connection` and of its :class:`~mesh._pubsub.PubSub` (they
share one, so both sit on the same node):

* **standalone** (``redis://``, ``rediss://``, ``unix://``): the node in the URL. A TCP
  URL that turns out to name a Redis Cluster node is treated as a cluster seed.
* **Sentinel** (``redis+sentinel://``): each sentinel in turn is asked
  ``SENTINEL GET-MASTER-ADDR-BY-NAME``; the first answer wins. While the
  sentinels announce a failover (:mod:`mesh._failover`, watched by the command
  connection), the old master is not used: the replica is taken as soon as
  its promotion is announced, and after a switch a sentinel still naming the old
  master is not believed.
* **Cluster** (``redis+cluster://``, or detected): the master serving the hash slot of
  the route key (``{namespace}:``), read from ``CLUSTER SHARDS`` (``CLUSTER SLOTS`` on
  6.2) of the node we reached, seeds tried in turn (the last master first).

Before a connection is handed over, ``ROLE`` (sent in the same write as ``AUTH``,
``SELECT`` and ``CLIENT SETNAME``) must say ``master``: a node the topology does not
name as master is refused, so an old master restarted empty, a replica, or a node
that lost its slot never takes a write. A user whose ACL forbids ``ROLE`` is let
through on standalone and cluster (where ``CLUSTER SHARDS`` tells the role too),
refused on Sentinel.

With an ``epoch_key`` (a client's or worker's namespace), the node must also
hold the namespace's epoch this process first saw (:mod:`mesh._epoch`): on
Sentinel and Cluster a master restarted empty is refused.

Errors: every failure is a :class:`~mesh.MeshConnectionError` (the reconnect loop
tries again); messages name redacted addresses only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import anyio
import attrs

from ._epoch import Epoch
from ._errors import CommandError, MeshConnectionError
from ._failover import FailoverWatch
from ._keys import Keys
from ._loop import ByteStream, aclose_forcefully
from ._transport import TRANSPORT_ERRORS, Arg, connect, next_reply, pack, scrub
from ._url import RedisConfig

__all__ = ["Topology", "keyslot", "namespace_slot"]

Node = tuple[str, int]

_SLOTS: Final = 16384
# The most nodes one connect may hop through (seed -> slot master -> ...): a map that
# keeps changing under us is a failover in progress; the reconnect loop tries again.
_MAX_HOPS: Final = 3
# The longest a connection keeps off a master being failed over (from +odown or
# +try-failover) when no announcement ends the failover first (the switch, an
# abort, -odown). Writing there instead would be worse: the old master takes
# writes, lease renewals included, that its demotion drops. Holding is safe for
# a worker: its handlers stop at R without a confirmed renewal, as in any outage.
FAILOVER_HOLD: Final = 5.0


def _crc16_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        table.append(crc & 0xFFFF)
    return table


_CRC16: Final = _crc16_table()


def crc16(data: bytes) -> int:
    """CRC16-CCITT (XMODEM), the checksum Redis Cluster hashes keys with."""
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ byte) & 0xFF]
    return crc


def keyslot(key: bytes | str) -> int:
    """The Redis Cluster hash slot of ``key`` (0..16383), honouring a ``{hash tag}``.

    Matches ``CLUSTER KEYSLOT``: if the key has a ``{`` followed later by a ``}`` with
    at least one byte between them, only those bytes are hashed.
    """
    if isinstance(key, str):
        key = key.encode()
    start = key.find(b"{")
    if start != -1:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return crc16(key) % _SLOTS


def namespace_slot(namespace: str) -> int:
    """The Redis Cluster hash slot that holds every key of ``namespace``.

    Use it to choose namespace names that land on different masters (see
    docs/operating.md, "Several namespaces on one cluster").

    Raises:
        ConfigError: not a valid namespace name.
    """
    return keyslot(Keys(namespace).prefix)


@attrs.frozen
class _Probe:
    """What the handshake learned about the node it reached."""

    role: bytes | None  # b"master", b"slave", b"sentinel"; None if ROLE was refused (ACL)
    master_of_replica: Node | None
    cluster: bool
    myid: bytes | None
    shards: list[tuple[int, int, Node, bytes | None]] | None  # (first, last, master, id)
    epoch: list[Any] = attrs.field(factory=list)  # the replies of Epoch.commands()


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pairs(flat: Any) -> dict[bytes, Any]:
    it = iter(flat)
    return dict(zip(it, it, strict=False))


def parse_shards(reply: Any, tls: bool) -> list[tuple[int, int, Node, bytes | None]]:
    """``CLUSTER SHARDS`` (7.0+) -> (first slot, last slot, master address, master id).

    Failed masters are left out (their slots have no usable master right now).
    """
    out: list[tuple[int, int, Node, bytes | None]] = []
    for shard in reply:
        fields = _pairs(shard)
        slots = list(fields.get(b"slots") or [])
        master: tuple[Node, bytes | None] | None = None
        for node in fields.get(b"nodes") or []:
            info = _pairs(node)
            if info.get(b"role") != b"master" or info.get(b"health") == b"fail":
                continue
            host = _decode(info.get(b"endpoint") or info.get(b"ip") or b"")
            port = info.get(b"tls-port") if tls and info.get(b"tls-port") else info.get(b"port")
            if host in ("", "?") or not port:
                continue
            master = ((host, int(port)), info.get(b"id"))
        if master is None:
            continue
        for first, last in zip(slots[::2], slots[1::2], strict=False):
            out.append((int(first), int(last), master[0], master[1]))
    return out


def parse_slots(reply: Any) -> list[tuple[int, int, Node, bytes | None]]:
    """``CLUSTER SLOTS`` (the 6.2 fallback) -> as :func:`parse_shards`."""
    out: list[tuple[int, int, Node, bytes | None]] = []
    for entry in reply:
        first, last, master = entry[0], entry[1], entry[2]
        host = _decode(master[0])
        if not host or host == "?":
            continue
        node_id = master[2] if len(master) > 2 and isinstance(master[2], bytes) else None
        out.append((int(first), int(last), (host, int(master[1])), node_id))
    return out


class Topology:
    """Finds the master for one :class:`RedisConfig` and remembers where it is.

    One is shared by a connection and its pub/sub connection: when either lands on
    a new master, the other is told (:meth:`wait_moved`) and follows, because key-expiry
    events are published only on the node that holds the keys.

    Args:
        config: the URL's configuration.
        route_key: a key whose hash slot decides the master on a cluster (for a
            namespace, its prefix ``{ns}:``). Without it, a cluster connection goes
            to the master of slot 0.
    """

    def __init__(
        self,
        config: RedisConfig,
        route_key: bytes | str | None = None,
        epoch_key: str | None = None,
    ) -> None:
        self.config = config
        # The namespace's epoch (mesh._epoch), checked on every connect; on
        # Sentinel and Cluster a node without it is refused.
        self.epoch: Epoch | None = None
        if epoch_key is not None:
            strict = config.topology in ("sentinel", "cluster")
            self.epoch = Epoch(epoch_key, strict=strict)
        self.slot = keyslot(route_key) if route_key is not None else 0
        self.master: Node | None = None
        self.cluster = config.topology == "cluster"
        self.changes = 0
        self._changed = anyio.Event()
        # Set (and replaced) each time a connection gets through: the other
        # connection, waiting out a reconnect backoff, tries at once.
        self._reached = anyio.Event()
        # CLUSTER SHARDS is unknown before 7.0: once refused, use CLUSTER SLOTS.
        self._use_slots = False
        # The sentinel that last told a connection the master had moved.
        self._preferred_sentinel: Node | None = None
        # Sentinel: the failover announcements, once a connection runs the
        # watch (FailoverWatch.run); connections keep off a master that is
        # being failed over for at most ``hold`` (see mesh._failover).
        self.failover: FailoverWatch | None = None
        if config.topology == "sentinel":
            self.failover = FailoverWatch(config.service or "", FAILOVER_HOLD)

    # ---------------------------------------------------------------- public

    async def connect(
        self, *, name: str | None = None, extra: Sequence[Sequence[Arg]] = ()
    ) -> tuple[ByteStream, Any, list[Any], Node]:
        """Find the master, connect to it and run the handshake (see the module docstring).

        Returns:
            The stream, its reader, the replies of ``extra`` and the master's address.

        Raises:
            MeshConnectionError: no master could be found or reached, or the node
                reached is not the master; the message says why (redacted).
            ConfigError: the CA file cannot be loaded.

        On cancellation nothing is left open.
        """
        found = await self._connect(name, extra)
        self._reached.set()
        self._reached = anyio.Event()
        return found

    def reached(self) -> anyio.Event:
        """An event set the next time a connection of this topology gets through
        (:meth:`connect` returns): a connection that waits to reconnect waits on it
        too, so that after an outage both are back as soon as the server is."""
        return self._reached

    async def _connect(
        self, name: str | None, extra: Sequence[Sequence[Arg]]
    ) -> tuple[ByteStream, Any, list[Any], Node]:
        config = self.config
        if config.topology == "sentinel":
            return await self._connect_sentinel(extra, name)
        if config.path is not None:
            stream, reader, replies, probe = await self._open(None, extra, name, cluster=False)
            self._refuse_replica(probe, None, stream)
            await self._judge_epoch(probe, None, stream)
            return stream, reader, replies, ("", 0)
        return await self._connect_tcp(extra, name)

    async def _connect_sentinel(
        self, extra: Sequence[Sequence[Arg]], name: str | None
    ) -> tuple[ByteStream, Any, list[Any], Node]:
        """Sentinel: while a failover is announced (:mod:`mesh._failover`), keep
        off the old master and take the replica as soon as its promotion is
        announced (bounded by the watch's hold); otherwise the master the sentinels
        name, unless a switch was announced away from it."""
        watch = self.failover
        if watch is not None and watch.running:
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
        target = await self._ask_sentinels()
        if watch is not None:
            new = watch.replaced(target)
            if new is not None:
                try:
                    return await self._open_master(new, extra, name, "was switched to")
                except MeshConnectionError:
                    watch.forget_switch()  # a later failover we missed: ask again
                    target = await self._ask_sentinels()
        return await self._open_master(target, extra, name, "is named")

    async def _open_master(
        self, target: Node, extra: Sequence[Sequence[Arg]], name: str | None, why: str
    ) -> tuple[ByteStream, Any, list[Any], Node]:
        """Sentinel: connect to ``target`` and keep it only if ``ROLE`` says master."""
        config = self.config
        stream, reader, replies, probe = await self._open(target, extra, name, cluster=False)
        if probe.role is None:
            await aclose_forcefully(stream)
            raise MeshConnectionError(
                f"the user may not run ROLE on {self._show(target)}: trio-mesh needs it "
                "on Sentinel to refuse a node that is not the master"
            )
        if probe.role != b"master":
            await aclose_forcefully(stream)
            raise MeshConnectionError(
                f"{self._show(target)} {why} master of {config.service!r} by Sentinel, but "
                f"it says it is a {_role_name(probe)}; waiting for Sentinel to catch up"
            )
        await self._judge_epoch(probe, target, stream)
        self._arrived(target)
        return stream, reader, replies, target

    async def _judge_epoch(self, probe: _Probe, node: Node | None, stream: ByteStream) -> None:
        """Refuse (close ``stream`` and raise MeshConnectionError) a node that
        lacks the namespace's epoch this process knew (see mesh._epoch)."""
        if self.epoch is None:
            return
        try:
            self.epoch.check(probe.epoch, self._show(node))
        except MeshConnectionError:
            await aclose_forcefully(stream)
            raise

    def sentinel_configs(self) -> list[RedisConfig]:
        """The configuration of each sentinel of the URL (Sentinel only)."""
        return [self._sentinel_config(node) for node in self.config.nodes]

    async def wait_moved(self, node: Node) -> None:
        """Return once the known master is no longer ``node`` (the other connection
        sharing this topology found a new one). Cancellation is harmless."""
        while self.master is None or self.master == node:
            await self._changed.wait()

    # ---------------------------------------------------------------- internals

    def _arrived(self, node: Node) -> None:
        if node != self.master:
            self.master = node
            self.changes += 1
            self._changed.set()
            self._changed = anyio.Event()

    def _show(self, node: Node | None) -> str:
        if node is None:
            return self.config.redacted()
        host = f"[{node[0]}]" if ":" in node[0] else node[0]
        return f"{host}:{node[1]}"

    def node_config(self, node: Node) -> RedisConfig:
        """The URL's configuration (credentials, TLS, timeouts) aimed at ``node``."""
        return attrs.evolve(
            self.config,
            host=node[0],
            port=node[1],
            path=None,
            topology="standalone",
            nodes=(),
            service=None,
            sentinel_username=None,
            sentinel_password=None,
        )

    async def _open(
        self,
        node: Node | None,
        extra: Sequence[Sequence[Arg]],
        name: str | None,
        *,
        cluster: bool | None,
    ) -> tuple[ByteStream, Any, list[Any], _Probe]:
        """Connect to ``node`` (None: the URL's own address) with the handshake, ROLE
        and, unless ``cluster`` is False, the cluster probes; then ``extra``."""
        config = self.config if node is None else self.node_config(node)
        probes: list[Sequence[Arg]] = [("ROLE",)]
        if cluster is not False:
            probes.append(("CLUSTER", "MYID"))
            probes.append(("CLUSTER", "SLOTS") if self._use_slots else ("CLUSTER", "SHARDS"))
        probed = len(probes)
        if self.epoch is not None:
            probes.extend(self.epoch.commands())
        try:
            stream, reader, replies = await connect(config, name=name, extra=[*probes, *extra])
        except MeshConnectionError as exc:
            if cluster is not False and await self._refused_db_on_cluster(config, exc):
                raise MeshConnectionError(
                    f"{self._show(node)} is a cluster node that does not serve db "
                    f"{config.db} (Redis Cluster serves db 0 only, Valkey 9 the dbs below "
                    f"its cluster-databases): {exc.__cause__}"
                ) from None
            raise
        probe_replies, rest = replies[: len(probes)], replies[len(probes) :]
        try:
            probe = self._parse_probe(probe_replies[:probed])
        except MeshConnectionError:
            await aclose_forcefully(stream)
            raise
        probe = attrs.evolve(probe, epoch=probe_replies[probed:])
        if probe.cluster and probe.shards is None and not self._use_slots:
            # A 6.2 cluster: CLUSTER SHARDS is unknown there; ask CLUSTER SLOTS.
            self._use_slots = True
            await aclose_forcefully(stream)
            return await self._open(node, extra, name, cluster=cluster)
        return stream, reader, rest, probe

    @staticmethod
    async def _refused_db_on_cluster(config: RedisConfig, exc: MeshConnectionError) -> bool:
        """Whether ``exc`` is our db's ``SELECT`` refused by a cluster node. The
        refusal's code is ``ERR`` whatever the reason (a cluster's db 0 only, or
        a db out of range), so the node is asked, on db 0, whether it is one
        (``CLUSTER MYID``) rather than the reply's wording read. False if that
        cannot be told (the node unreachable now); cancellation propagates."""
        if not config.db or not str(exc).startswith("SELECT failed"):
            return False
        if not isinstance(exc.__cause__, CommandError):
            return False
        try:
            stream, _, replies = await connect(
                attrs.evolve(config, db=0), extra=[("CLUSTER", "MYID")]
            )
        except MeshConnectionError:
            return False
        await aclose_forcefully(stream)
        return isinstance(replies[0], bytes)

    def _parse_probe(self, replies: list[Any]) -> _Probe:
        role_reply = replies[0]
        role: bytes | None = None
        upstream: Node | None = None
        if isinstance(role_reply, CommandError):
            # NOPERM: an ACL user without ROLE; NOAUTH: no password given (every
            # command will say so). Neither can be checked here.
            if role_reply.code not in ("NOPERM", "NOAUTH", "ERR"):
                raise MeshConnectionError(f"ROLE failed: {role_reply}")
        elif isinstance(role_reply, list) and role_reply:
            role = role_reply[0]
            if role == b"slave" and len(role_reply) >= 3:
                upstream = (_decode(role_reply[1]), int(role_reply[2]))
        cluster = False
        myid: bytes | None = None
        shards = None
        if len(replies) >= 3:
            myid_reply, map_reply = replies[1], replies[2]
            if isinstance(myid_reply, bytes):
                cluster = True
                myid = myid_reply
            elif isinstance(myid_reply, CommandError) and myid_reply.code != "ERR":
                # refused by ACL (NOPERM) or not answered now: trust what we knew;
                # ERR is a server with cluster support disabled
                cluster = self.cluster
            if cluster:
                if isinstance(map_reply, CommandError):
                    if map_reply.code == "ERR" and not self._use_slots:
                        # 6.2 knows no CLUSTER SHARDS: the caller retries once with
                        # CLUSTER SLOTS, whose own error is raised
                        shards = None
                    else:
                        raise MeshConnectionError(f"reading the cluster map failed: {map_reply}")
                elif self._use_slots:
                    shards = parse_slots(map_reply)
                else:
                    shards = parse_shards(map_reply, self.config.tls)
        return _Probe(role, upstream, cluster, myid, shards)

    def _refuse_replica(self, probe: _Probe, node: Node | None, stream: ByteStream) -> None:
        if probe.role in (None, b"master"):
            if node is not None:
                self._arrived(node)
            return
        raise MeshConnectionError(
            f"{self._show(node)} is a {_role_name(probe)}, not a master: trio-mesh writes, "
            "so name the master (or use redis+sentinel:// to follow it)"
        )

    async def _connect_tcp(
        self, extra: Sequence[Sequence[Arg]], name: str | None
    ) -> tuple[ByteStream, Any, list[Any], Node]:
        config = self.config
        seeds: list[Node | None]
        if config.topology == "cluster":
            seeds = list(dict.fromkeys([self.master, *config.nodes]))
            seeds = [s for s in seeds if s is not None]
        else:
            # standalone: the URL's node; if it is a cluster, the master we last
            # used is tried first (the URL's node may be down or a replica now)
            seeds = [None]
            if self.cluster and self.master is not None:
                seeds.insert(0, self.master)
        errors: list[MeshConnectionError] = []
        for seed in seeds:
            try:
                return await self._via(seed, extra, name)
            except MeshConnectionError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise MeshConnectionError("; ".join(dict.fromkeys(str(e) for e in errors))) from errors[-1]

    async def _via(
        self, seed: Node | None, extra: Sequence[Sequence[Arg]], name: str | None
    ) -> tuple[ByteStream, Any, list[Any], Node]:
        """Connect to ``seed``; on a cluster, hop to the slot's master."""
        node = seed
        for _ in range(_MAX_HOPS):
            stream, reader, replies, probe = await self._open(node, extra, name, cluster=None)
            here = node if node is not None else (self.config.host, self.config.port)
            if not probe.cluster:
                if self.config.topology == "cluster":
                    await aclose_forcefully(stream)
                    raise MeshConnectionError(
                        f"{self._show(node)} is not a Redis Cluster node (cluster support "
                        "is disabled there); use redis:// for a standalone server"
                    )
                try:
                    self._refuse_replica(probe, here, stream)
                except MeshConnectionError:
                    await aclose_forcefully(stream)
                    raise
                await self._judge_epoch(probe, here, stream)
                return stream, reader, replies, here
            self.cluster = True
            assert probe.shards is not None
            owner = next(
                (
                    (addr, nid)
                    for first, last, addr, nid in probe.shards
                    if first <= self.slot <= last
                ),
                None,
            )
            if owner is None:
                await aclose_forcefully(stream)
                raise MeshConnectionError(
                    f"no master serves hash slot {self.slot} (cluster map read on "
                    f"{self._show(node)}); the cluster is failing over or incomplete"
                )
            addr, owner_id = owner
            is_me = owner_id is not None and owner_id == probe.myid
            if is_me or (owner_id is None and addr == here):
                if probe.role not in (None, b"master"):
                    await aclose_forcefully(stream)
                    raise MeshConnectionError(
                        f"{self._show(here)} owns slot {self.slot} by its map but says it "
                        f"is a {_role_name(probe)}"
                    )
                if self.epoch is not None:
                    self.epoch.strict = True  # a cluster: another node may take over
                await self._judge_epoch(probe, addr, stream)
                self._arrived(addr)
                return stream, reader, replies, addr
            await aclose_forcefully(stream)
            node = addr
        raise MeshConnectionError(
            f"the cluster map kept changing while looking for the master of slot {self.slot}"
        )

    async def watch_sentinels(self, node: Node, interval: float) -> Node:
        """Sentinel only: ask the sentinels every ``interval`` seconds which node is
        the master, on one connection kept open (the next sentinel in the list
        when one fails), and return the master they name once it is not ``node``.

        A failover that leaves the old master reachable (``SENTINEL FAILOVER``, a
        partition that heals) does not break a connection to it: the old master
        takes writes until Sentinel reconfigures it as a replica, seconds later.
        A connection that watches the sentinels leaves it within ``interval``.

        Errors of one round (no sentinel answers) are ignored: the next round
        tries again. Cancellation closes the sentinel connection.
        """
        config = self.config
        sentinels = list(config.nodes)
        command = ("SENTINEL", "GET-MASTER-ADDR-BY-NAME", config.service or "")
        stream: ByteStream | None = None
        reader: Any = None
        try:
            while True:
                await anyio.sleep(interval)
                for _ in range(len(sentinels)):
                    try:
                        with anyio.fail_after(config.connect_timeout):
                            if stream is None:
                                one = self._sentinel_config(sentinels[0])
                                stream, reader, replies = await connect(one, extra=[command])
                                reply = replies[0]
                            else:
                                await stream.send_all(b"".join(pack(command)))
                                reply = await next_reply(stream, reader)
                    except (MeshConnectionError, TimeoutError, *TRANSPORT_ERRORS):
                        if stream is not None:
                            await aclose_forcefully(stream)
                            stream = None
                        sentinels.append(sentinels.pop(0))  # the next one, next time
                        continue
                    if isinstance(reply, list) and len(reply) == 2:
                        named = (_decode(reply[0]), int(reply[1]))
                        watch = self.failover
                        if watch is not None and watch.replaced(named) == node:
                            break  # a sentinel that has not caught up with the switch
                        if named != node:
                            # Ask this sentinel first on the reconnect: another
                            # one may not have heard of the failover yet.
                            self._preferred_sentinel = sentinels[0]
                            return named
                    break
        finally:
            if stream is not None:
                await aclose_forcefully(stream)

    def _sentinel_config(self, sentinel: Node) -> RedisConfig:
        config = self.config
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

    async def _ask_sentinels(self) -> Node:
        config = self.config
        errors: list[str] = []
        nodes = list(config.nodes)
        preferred = self._preferred_sentinel
        if preferred in nodes:
            nodes.remove(preferred)
            nodes.insert(0, preferred)
        for host, port in nodes:
            one = self._sentinel_config((host, port))
            try:
                stream, _, replies = await connect(
                    one, extra=[("SENTINEL", "GET-MASTER-ADDR-BY-NAME", config.service or "")]
                )
            except MeshConnectionError as exc:
                errors.append(str(exc))
                if (host, port) == self._preferred_sentinel:
                    self._preferred_sentinel = None  # back to the URL's order
                continue
            await aclose_forcefully(stream)
            reply = replies[0]
            if isinstance(reply, list) and len(reply) == 2:
                return _decode(reply[0]), int(reply[1])
            where = self._show((host, port))
            if reply is None:
                errors.append(f"sentinel {where} does not know the master {config.service!r}")
            else:
                errors.append(f"sentinel {where} answered {reply!r:.100}")
        raise MeshConnectionError(scrub("no sentinel named a master: " + "; ".join(errors), config))


def _role_name(probe: _Probe) -> str:
    if probe.role == b"slave":
        upstream = probe.master_of_replica
        return "replica" + (f" of {upstream[0]}:{upstream[1]}" if upstream else "")
    return (probe.role or b"?").decode(errors="replace")
