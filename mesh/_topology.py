"""Where is the master now: one :class:`Topology` per URL, whatever its kind.

A :class:`Topology` is asked on every connect and reconnect of a
:class:`~mesh._connection.Connection` and of its :class:`~mesh._pubsub.PubSub` (they
share one, so both sit on the same node). It hands the question to the finder of
the URL's kind, one class each behind one interface (:class:`~mesh._probe.Finder`):

* **standalone** (``redis://``, ``rediss://``, ``unix://``, :class:`Standalone`
  here): the node in the URL. A TCP URL that turns out to name a Redis Cluster
  node is treated as a cluster seed.
* **Sentinel** (``redis+sentinel://``, :class:`~mesh._sentinel.Sentinel`): the
  master the sentinels name, kept off a master being failed over.
* **Cluster** (``redis+cluster://``, :class:`~mesh._cluster.Cluster`): the master
  serving the hash slot of the route key (``{namespace}:``).

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
from typing import Final

import anyio

from ._cluster import Cluster, keyslot, namespace_slot, through
from ._epoch import Epoch
from ._probe import Finder, Found, Node, Nodes
from ._sentinel import Sentinel
from ._transport import Arg
from ._url import RedisConfig

__all__ = ["Node", "Topology", "keyslot", "namespace_slot"]


class Standalone(Finder):
    """A ``redis://``, ``rediss://`` or ``unix://`` URL: the node it names."""

    async def find(self, name: str | None, extra: Sequence[Sequence[Arg]]) -> Found:
        """The URL's node, refused unless it is a master; a TCP node that is a
        cluster node is a seed (the master we last used is tried first, as the
        URL's node may be down or a replica now)."""
        nodes = self.nodes
        if nodes.config.path is not None:
            stream, reader, replies, probe = await nodes.open(None, extra, name, cluster=False)
            await nodes.keep(probe, None, stream)
            return stream, reader, replies, ("", 0)
        seeds: list[Node | None] = [None]
        if nodes.cluster and nodes.master is not None:
            seeds.insert(0, nodes.master)
        return await through(nodes, seeds, extra, name, only_cluster=False)


#: The finder of each kind of URL (RedisConfig.topology).
_FINDERS: Final[dict[str, type[Finder]]] = {
    "standalone": Standalone,
    "sentinel": Sentinel,
    "cluster": Cluster,
}


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
        epoch_key: the namespace's epoch key (:mod:`mesh._epoch`), checked on
            every connect; on Sentinel and Cluster a node without it is refused.
    """

    def __init__(
        self,
        config: RedisConfig,
        route_key: bytes | str | None = None,
        epoch_key: str | None = None,
    ) -> None:
        self.config = config
        # strict (a node without it refused) where another node may take over:
        # the finder says (Finder.__init__)
        epoch = Epoch(epoch_key, strict=False) if epoch_key is not None else None
        slot = keyslot(route_key) if route_key is not None else 0
        self.nodes = Nodes(config, slot, epoch)
        # Set (and replaced) each time a connection gets through: the other
        # connection, waiting out a reconnect backoff, tries at once.
        self._reached = anyio.Event()
        self._finder = _FINDERS[config.topology](self.nodes)
        #: Sentinel: the failover announcements, once a connection runs the
        #: watch (FailoverWatch.run, with :meth:`sentinel_configs`); else None.
        self.failover = self._finder.failover

    @property
    def epoch(self) -> Epoch | None:
        """The namespace's epoch checked on every connect, if any."""
        return self.nodes.epoch

    @property
    def master(self) -> Node | None:
        """The master a connection of this topology last reached."""
        return self.nodes.master

    @property
    def cluster(self) -> bool:
        """Whether the URL names a cluster (or its node turned out to be one)."""
        return self.nodes.cluster

    @property
    def changes(self) -> int:
        """How many times the master changed."""
        return self.nodes.changes

    async def connect(
        self, *, name: str | None = None, extra: Sequence[Sequence[Arg]] = ()
    ) -> Found:
        """Find the master, connect to it and run the handshake (see the module docstring).

        Returns:
            The stream, its reader, the replies of ``extra`` and the master's address.

        Raises:
            MeshConnectionError: no master could be found or reached, or the node
                reached is not the master; the message says why (redacted).
            ConfigError: the CA file cannot be loaded.

        On cancellation nothing is left open.
        """
        found = await self._finder.find(name, extra)
        self._reached.set()
        self._reached = anyio.Event()
        return found

    def reached(self) -> anyio.Event:
        """An event set the next time a connection of this topology gets through
        (:meth:`connect` returns): a connection that waits to reconnect waits on it
        too, so that after an outage both are back as soon as the server is."""
        return self._reached

    async def wait_moved(self, node: Node) -> None:
        """Return once the known master is no longer ``node`` (the other connection
        sharing this topology found a new one). Cancellation is harmless."""
        await self.nodes.wait_moved(node)

    async def wait_left(self, node: Node, interval: float) -> str:
        """Return why the master is no longer ``node``, once it is not: the other
        connection found a new one or, on Sentinel, the sentinels (asked every
        ``interval`` seconds) name another or announce a failover of it.
        Cancellation is harmless."""
        return await self._finder.wait_left(node, interval)

    def sentinel_configs(self) -> list[RedisConfig]:
        """The configuration of each sentinel of the URL (Sentinel only; else none)."""
        return self._finder.sentinel_configs()

    def node_config(self, node: Node) -> RedisConfig:
        """The URL's configuration (credentials, TLS, timeouts) aimed at ``node``."""
        return self.nodes.node_config(node)
