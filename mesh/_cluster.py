"""Redis Cluster: the hash slot of a key, the cluster map, and the hop to a slot's master.

A namespace's keys share one hash slot (``{ns}``), so one connection to the master
that serves it is enough. :class:`Cluster` finds that master for a
``redis+cluster://`` URL: it reads the cluster map (``CLUSTER SHARDS``, or
``CLUSTER SLOTS`` on 6.2) of the node it reached, seeds tried in turn (the last
master first), and hops to the slot's master. A plain ``redis://`` URL that turns
out to name a cluster node takes the same hop (:func:`hop`).

Errors: every failure is a :class:`~mesh.MeshConnectionError` (the reconnect loop
tries again); messages name redacted addresses only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from ._errors import MeshConnectionError
from ._keys import Keys
from ._loop import aclose_forcefully
from ._probe import Finder, Found, Node, Nodes, decode, role_name
from ._transport import Arg

__all__ = [
    "Cluster",
    "crc16",
    "hop",
    "keyslot",
    "namespace_slot",
    "parse_shards",
    "parse_slots",
    "through",
]

_SLOTS: Final = 16384
# The most nodes one connect may hop through (seed -> slot master -> ...): a map that
# keeps changing under us is a failover in progress; the reconnect loop tries again.
_MAX_HOPS: Final = 3

Shard = tuple[int, int, Node, bytes | None]  # (first slot, last slot, master, master id)


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


def _pairs(flat: Any) -> dict[bytes, Any]:
    it = iter(flat)
    return dict(zip(it, it, strict=False))


def parse_shards(reply: Any, tls: bool) -> list[Shard]:
    """``CLUSTER SHARDS`` (7.0+) -> (first slot, last slot, master address, master id).

    Failed masters are left out (their slots have no usable master right now).
    """
    out: list[Shard] = []
    for shard in reply:
        fields = _pairs(shard)
        slots = list(fields.get(b"slots") or [])
        master: tuple[Node, bytes | None] | None = None
        for node in fields.get(b"nodes") or []:
            info = _pairs(node)
            if info.get(b"role") != b"master" or info.get(b"health") == b"fail":
                continue
            host = decode(info.get(b"endpoint") or info.get(b"ip") or b"")
            port = info.get(b"tls-port") if tls and info.get(b"tls-port") else info.get(b"port")
            if host in ("", "?") or not port:
                continue
            master = ((host, int(port)), info.get(b"id"))
        if master is None:
            continue
        for first, last in zip(slots[::2], slots[1::2], strict=False):
            out.append((int(first), int(last), master[0], master[1]))
    return out


def parse_slots(reply: Any) -> list[Shard]:
    """``CLUSTER SLOTS`` (the 6.2 fallback) -> as :func:`parse_shards`."""
    out: list[Shard] = []
    for entry in reply:
        first, last, master = entry[0], entry[1], entry[2]
        host = decode(master[0])
        if not host or host == "?":
            continue
        node_id = master[2] if len(master) > 2 and isinstance(master[2], bytes) else None
        out.append((int(first), int(last), (host, int(master[1])), node_id))
    return out


async def through(
    nodes: Nodes,
    seeds: Sequence[Node | None],
    extra: Sequence[Sequence[Arg]],
    name: str | None,
    *,
    only_cluster: bool,
) -> Found:
    """:func:`hop` from each of ``seeds`` in turn until one gets through.

    Raises:
        MeshConnectionError: every seed failed; the message joins their reasons.
    """
    errors: list[MeshConnectionError] = []
    for seed in seeds:
        try:
            return await hop(nodes, seed, extra, name, only_cluster=only_cluster)
        except MeshConnectionError as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    raise MeshConnectionError("; ".join(dict.fromkeys(str(e) for e in errors))) from errors[-1]


async def hop(
    nodes: Nodes,
    seed: Node | None,
    extra: Sequence[Sequence[Arg]],
    name: str | None,
    *,
    only_cluster: bool,
) -> Found:
    """Connect to ``seed`` (None: the URL's node); on a cluster, hop to the master
    of ``nodes.slot``. A node that is no cluster node is kept if it is a master,
    unless ``only_cluster`` (a ``redis+cluster://`` URL)."""
    node = seed
    config = nodes.config
    for _ in range(_MAX_HOPS):
        stream, reader, replies, probe = await nodes.open(node, extra, name, cluster=None)
        here = node if node is not None else (config.host, config.port)
        if not probe.cluster:
            if only_cluster:
                await aclose_forcefully(stream)
                raise MeshConnectionError(
                    f"{nodes.show(node)} is not a Redis Cluster node (cluster support "
                    "is disabled there); use redis:// for a standalone server"
                )
            await nodes.keep(probe, here, stream)
            return stream, reader, replies, here
        nodes.cluster = True
        if nodes.use_slots:
            shards = parse_slots(probe.cluster_map)
        else:
            shards = parse_shards(probe.cluster_map, config.tls)
        owner = next(
            ((addr, nid) for first, last, addr, nid in shards if first <= nodes.slot <= last),
            None,
        )
        if owner is None:
            await aclose_forcefully(stream)
            raise MeshConnectionError(
                f"no master serves hash slot {nodes.slot} (cluster map read on "
                f"{nodes.show(node)}); the cluster is failing over or incomplete"
            )
        addr, owner_id = owner
        is_me = owner_id is not None and owner_id == probe.myid
        if is_me or (owner_id is None and addr == here):
            if probe.role not in (None, b"master"):
                await aclose_forcefully(stream)
                raise MeshConnectionError(
                    f"{nodes.show(here)} owns slot {nodes.slot} by its map but says it "
                    f"is a {role_name(probe)}"
                )
            if nodes.epoch is not None:
                nodes.epoch.strict = True  # a cluster: another node may take over
            await nodes.judge_epoch(probe, addr, stream)
            nodes.arrived(addr)
            return stream, reader, replies, addr
        await aclose_forcefully(stream)
        node = addr
    raise MeshConnectionError(
        f"the cluster map kept changing while looking for the master of slot {nodes.slot}"
    )


class Cluster(Finder):
    """A ``redis+cluster://`` URL: the seeds, the master we last used first."""

    takes_over = True

    def __init__(self, nodes: Nodes) -> None:
        super().__init__(nodes)
        nodes.cluster = True

    async def find(self, name: str | None, extra: Sequence[Sequence[Arg]]) -> Found:
        """Connect to the master of the slot (see :func:`hop`)."""
        nodes = self.nodes
        seeds = [s for s in dict.fromkeys([nodes.master, *nodes.config.nodes]) if s is not None]
        return await through(nodes, seeds, extra, name, only_cluster=True)
