"""The client: put tasks on queues, cancel them, look at the mesh.

A client is not a peer: it holds no lease and runs no task of its own, so it
is cheap and can live anywhere (a web handler, a cron job, the CLI).
:class:`Client` is composed of its parts, one module each over
:mod:`mesh._client_core`: writes of tasks (:mod:`mesh._client_writes`),
administration of queues (:mod:`mesh._client_admin`), looks
(:mod:`mesh._client_reads`) and results (:mod:`mesh._client_results`). Every
read goes through one :class:`~mesh._reads.Reader` (:attr:`Client.reads`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.lowlevel

from ._binding import Binding
from ._client_admin import ClientAdmin
from ._client_core import DEFAULT_MAX_PAYLOAD
from ._client_groups import ClientGroups
from ._client_reads import ClientReads
from ._client_results import ClientResults
from ._client_writes import MAX_PRIORITY, ClientWrites, check_priority
from ._connection import Connection, open_connection
from ._diskless import warn_diskless_delay
from ._keys import Keys
from ._loop import require_loop
from ._reads import Reader
from ._topology import Topology
from ._url import RedisConfig, check_min_replicas, coerce_config
from ._validate import whole

__all__ = ["DEFAULT_MAX_PAYLOAD", "MAX_PRIORITY", "Client", "check_priority", "open_client"]


class Client(ClientWrites, ClientAdmin, ClientGroups, ClientReads, ClientResults):
    """Operations on the queues of one namespace. Get one from :func:`open_client`
    (or :attr:`Worker.client`).

    Every method is one or a few Redis round trips. On a broken connection a
    method raises :class:`MeshConnectionError`; whether a write that was in
    flight happened is then unknown (enqueue is at-least-once: retrying may
    enqueue twice). On cancellation the same holds: the command may or may not
    have run.
    """

    def __init__(
        self,
        conn: Connection,
        keys: Keys,
        *,
        min_replicas: int,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ):
        """A client on ``conn``, in the namespace of ``keys``.

        Args:
            min_replicas: replicas that must acknowledge an enqueue or ensure
                before it returns (0: none). Required, so that no client is
                built without deciding it (a fleet's client once ignored it).
            max_payload: refuse task payloads longer than this many bytes.

        Raises:
            ConfigError: ``min_replicas`` is not a whole number >= 0.
        """
        self._min_replicas = whole("min_replicas", min_replicas, 0)
        self._conn = conn
        self._keys = keys
        self._binding = Binding(keys)
        self._reads = Reader(conn, keys)
        self._max_payload = max_payload
        self.memory = self._reads.memory
        """Redis's memory and eviction policy as this client's reads for
        ``mesh status``, the dashboard and the exporter last saw them (see
        :mod:`mesh._memory`): a policy that can evict is logged once."""
        self.vanished = self._reads.vanished
        """Per queue, persistent tasks missing without a cancel, as last
        reported (see :func:`mesh._view.counts`)."""

    @property
    def namespace(self) -> str:
        """The namespace this client works in."""
        return self._keys.namespace

    @property
    def min_replicas(self) -> int:
        """Replicas that must acknowledge an enqueue or ensure before it
        returns (``WAIT``); fixed when the client is built."""
        return self._min_replicas

    @property
    def reads(self) -> Reader:
        """The reader this client reads the mesh's state through, which
        ``mesh status``, the dashboard and the exporter look through too
        (``mesh._view``); its own methods are not public API. Closed with
        the client."""
        return self._reads

    def close(self) -> None:
        """Refuse every call from now on (:class:`ClosedError`). The
        connection belongs to whoever opened it (:func:`open_client`, a
        worker or a fleet), which closes it when its block is left; they
        call this first. Safe to call twice."""
        self._reads.close()

    async def aclose(self) -> None:
        """:meth:`close`, as an async resource's close (it checkpoints)."""
        self.close()
        await anyio.lowlevel.checkpoint()


@asynccontextmanager
async def open_client(
    url: str | RedisConfig = "redis://127.0.0.1:6379",
    *,
    namespace: str = "mesh",
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    min_replicas: int | None = None,
) -> AsyncIterator[Client]:
    """Connect a :class:`Client` to the mesh ``namespace`` at ``url``.

    Args:
        url: ``redis://``, ``rediss://`` (TLS), ``unix://``, ``redis+sentinel://``
            or ``redis+cluster://`` URL (see :func:`~mesh.parse_url`). Replies that
            mean "not executed here" (a failover, a moved slot) are re-routed to
            the master and retried for up to the URL's ``connect_timeout``.
        namespace: isolates one mesh from others on the same Redis.
        max_payload: refuse task payloads longer than this many bytes.
        min_replicas: ``enqueue``/``ensure`` return only once this many
            replicas have the write (``WAIT``, up to ``connect_timeout``), else
            raise MeshConnectionError (see docs/guarantees.md). Default: the
            URL's ``min_replicas`` query parameter, else 0.

    Raises:
        ConfigError: a bad URL, namespace or ``min_replicas`` (before
            connecting); called outside trio (from asyncio, say).
        MeshConnectionError: Redis cannot be reached (fails fast).

    The connection is closed when the block is left; a cancelled block leaves
    nothing behind.
    """
    require_loop("mesh.open_client")
    keys = Keys(namespace)
    config = coerce_config(url)
    replicas = check_min_replicas(config, min_replicas)
    topology = Topology(config, route_key=keys.prefix, epoch_key=keys.epoch)
    async with open_connection(config, name=f"mesh-client:{namespace}", topology=topology) as conn:
        client = Client(conn, keys, min_replicas=replicas, max_payload=max_payload)
        await warn_diskless_delay(conn, replicas, "client")
        try:
            yield client
        finally:
            client.close()
