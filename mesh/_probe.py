"""The nodes of one URL as a topology reaches them: open one with the probes, judge it.

Every kind of topology (:mod:`mesh._topology`, :mod:`mesh._sentinel`,
:mod:`mesh._cluster`) opens a node the same way: the handshake of
:func:`~mesh._transport.connect` with ``ROLE`` (and, where a cluster may answer,
``CLUSTER MYID`` and the cluster map) and the namespace's epoch reads
(:mod:`mesh._epoch`) in the same write. :class:`Nodes` does that, keeps what is
shared by the connections of one topology (the master last reached, the hash slot
to route by, the epoch), and refuses a node that is not the master or lost the
namespace's epoch.

Errors: every failure is a :class:`~mesh.MeshConnectionError` (the reconnect loop
tries again); messages name redacted addresses only.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import anyio
import attrs

from ._epoch import Epoch
from ._errors import CommandError, MeshConnectionError
from ._loop import ByteStream, aclose_forcefully
from ._transport import Arg, connect
from ._url import RedisConfig

if TYPE_CHECKING:
    from ._failover import FailoverWatch

__all__ = ["Finder", "Found", "Node", "Nodes", "Probe", "decode", "role_name"]

Node: TypeAlias = tuple[str, int]
#: What a topology's connect returns: the stream, its reader, the replies of the
#: extra commands and the master's address (``("", 0)`` on a unix socket).
Found: TypeAlias = tuple[ByteStream, Any, list[Any], Node]


@attrs.frozen
class Probe:
    """What the handshake learned about the node it reached."""

    role: bytes | None  # b"master", b"slave", b"sentinel"; None if ROLE was refused (ACL)
    master_of_replica: Node | None
    cluster: bool
    myid: bytes | None
    #: The reply of CLUSTER SHARDS (or CLUSTER SLOTS, see Nodes.use_slots) on a
    #: cluster node; None elsewhere, and on a 6.2 node asked CLUSTER SHARDS.
    cluster_map: Any
    epoch: list[Any] = attrs.field(factory=list)  # the replies of Epoch.commands()


def decode(value: Any) -> str:
    """A host name from a reply (bytes) or a value already a str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def role_name(probe: Probe) -> str:
    """The node's role for a message: ``replica of host:port``, ``sentinel``..."""
    if probe.role == b"slave":
        upstream = probe.master_of_replica
        return "replica" + (f" of {upstream[0]}:{upstream[1]}" if upstream else "")
    return (probe.role or b"?").decode(errors="replace")


class Nodes:
    """Opens and judges the nodes of ``config``; remembers where the master is.

    Args:
        config: the URL's configuration.
        slot: the hash slot whose master a cluster connection goes to.
        epoch: the namespace's epoch to check on every connect, if any.
    """

    def __init__(self, config: RedisConfig, slot: int, epoch: Epoch | None) -> None:
        self.config = config
        self.slot = slot
        self.epoch = epoch
        self.master: Node | None = None
        # Whether the URL names a cluster, or its node turned out to be a cluster node.
        self.cluster = False
        self.changes = 0
        self._changed = anyio.Event()
        # CLUSTER SHARDS is unknown before 7.0: once refused, use CLUSTER SLOTS.
        self.use_slots = False

    def arrived(self, node: Node) -> None:
        """A connection got through to the master ``node``."""
        if node != self.master:
            self.master = node
            self.changes += 1
            self._changed.set()
            self._changed = anyio.Event()

    async def wait_moved(self, node: Node) -> None:
        """Return once the known master is no longer ``node``. Cancellation is harmless."""
        while self.master is None or self.master == node:
            await self._changed.wait()

    def show(self, node: Node | None) -> str:
        """``node`` for a message (None: the URL's address, redacted)."""
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

    async def open(
        self,
        node: Node | None,
        extra: Sequence[Sequence[Arg]],
        name: str | None,
        *,
        cluster: bool | None,
    ) -> tuple[ByteStream, Any, list[Any], Probe]:
        """Connect to ``node`` (None: the URL's own address) with the handshake, ROLE
        and, unless ``cluster`` is False, the cluster probes; then ``extra``."""
        config = self.config if node is None else self.node_config(node)
        probes: list[Sequence[Arg]] = [("ROLE",)]
        if cluster is not False:
            probes.append(("CLUSTER", "MYID"))
            probes.append(("CLUSTER", "SLOTS") if self.use_slots else ("CLUSTER", "SHARDS"))
        probed = len(probes)
        if self.epoch is not None:
            probes.extend(self.epoch.commands())
        try:
            stream, reader, replies = await connect(config, name=name, extra=[*probes, *extra])
        except MeshConnectionError as exc:
            if cluster is not False and await _refused_db_on_cluster(config, exc):
                raise MeshConnectionError(
                    f"{self.show(node)} is a cluster node that does not serve db "
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
        if probe.cluster and probe.cluster_map is None and not self.use_slots:
            # A 6.2 cluster: CLUSTER SHARDS is unknown there; ask CLUSTER SLOTS.
            self.use_slots = True
            await aclose_forcefully(stream)
            return await self.open(node, extra, name, cluster=cluster)
        return stream, reader, rest, probe

    def _parse_probe(self, replies: list[Any]) -> Probe:
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
                upstream = (decode(role_reply[1]), int(role_reply[2]))
        cluster = False
        myid: bytes | None = None
        cluster_map = None
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
                if not isinstance(map_reply, CommandError):
                    cluster_map = map_reply
                elif map_reply.code != "ERR" or self.use_slots:
                    raise MeshConnectionError(f"reading the cluster map failed: {map_reply}")
                # else: 6.2 knows no CLUSTER SHARDS: the caller retries once with
                # CLUSTER SLOTS, whose own error is raised
        return Probe(role, upstream, cluster, myid, cluster_map)

    async def judge_epoch(self, probe: Probe, node: Node | None, stream: ByteStream) -> None:
        """Refuse (close ``stream`` and raise MeshConnectionError) a node that
        lacks the namespace's epoch this process knew (see mesh._epoch)."""
        if self.epoch is None:
            return
        try:
            self.epoch.check(probe.epoch, self.show(node))
        except MeshConnectionError:
            await aclose_forcefully(stream)
            raise

    async def keep(self, probe: Probe, node: Node | None, stream: ByteStream) -> None:
        """Keep ``stream`` to the standalone node ``node`` (None: the unix socket)
        unless ``probe`` names another role than master (ROLE refused: cannot
        tell) or the node lacks the epoch: then close it and raise
        MeshConnectionError. A master is remembered (before the epoch check)."""
        if probe.role in (None, b"master"):
            if node is not None:
                self.arrived(node)
            await self.judge_epoch(probe, node, stream)
            return
        await aclose_forcefully(stream)
        raise MeshConnectionError(
            f"{self.show(node)} is a {role_name(probe)}, not a master: trio-mesh writes, "
            "so name the master (or use redis+sentinel:// to follow it)"
        )


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
        stream, _, replies = await connect(attrs.evolve(config, db=0), extra=[("CLUSTER", "MYID")])
    except MeshConnectionError:
        return False
    await aclose_forcefully(stream)
    return isinstance(replies[0], bytes)


class Finder(abc.ABC):
    """What every kind of topology answers (standalone, Sentinel, Cluster), and
    the answers they share: override :meth:`find`; only Sentinel has a
    :attr:`failover` watch and sentinels."""

    #: The failover announcements the connection watches (Sentinel only).
    failover: FailoverWatch | None = None
    #: Whether another node may take over from the master (a failover, a slot
    #: that moves): then a node without the namespace's epoch is refused.
    takes_over: bool = False

    def __init__(self, nodes: Nodes) -> None:
        self.nodes = nodes
        if self.takes_over and nodes.epoch is not None:
            nodes.epoch.strict = True

    @abc.abstractmethod
    async def find(self, name: str | None, extra: Sequence[Sequence[Arg]]) -> Found:
        """Find the master, connect to it and run the handshake.

        Raises:
            MeshConnectionError: no master could be found or reached.
        """

    async def wait_left(self, node: Node, interval: float) -> str:
        """Return why the master is no longer ``node`` once it is not (here:
        another connection of the topology found a new one; ``interval`` is
        for the kinds that poll). Cancellation is harmless."""
        await self.nodes.wait_moved(node)
        return f"the master moved to {self.nodes.master}"

    def sentinel_configs(self) -> list[RedisConfig]:
        """The configuration of each sentinel of the URL (none here)."""
        return []
