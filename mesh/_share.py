"""Fair shares of persistent tasks, by weight against capacity: the limits
of a weight and a capacity, the arithmetic, and :class:`QueueBalance`, which
turns what Redis holds of a queue's shares into :class:`QueueShare` values.
Sync, no I/O: below the client (which shows shares) and the balancing
decisions of the worker runtime (:mod:`mesh._balance`), which both use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import attrs

from ._types import QueueShare
from ._validate import whole

__all__ = ["MAX_WEIGHT", "QueueBalance", "check_capacity", "check_weight", "fair_share"]

#: The largest weight of a task and capacity of a worker (both whole numbers
#: from 1).
MAX_WEIGHT = 1_000_000


def _check(value: object, what: str) -> None:
    whole(what, value, 1, MAX_WEIGHT)


def check_weight(weight: object) -> None:
    """Refuse a task weight that is not a whole number from 1 to
    :data:`MAX_WEIGHT`.

    Raises:
        ConfigError: with a one-line message.
    """
    _check(weight, "weight")


def check_capacity(capacity: object) -> None:
    """Refuse a worker capacity that is not a whole number from 1 to
    :data:`MAX_WEIGHT`.

    Raises:
        ConfigError: with a one-line message.
    """
    _check(capacity, "capacity")


def fair_share(total_weight: int, total_capacity: int, capacity: int = 1) -> float:
    """A worker's fair share of a queue: ``total_weight * capacity /
    total_capacity`` (a total capacity below 1 counts as 1)."""
    return total_weight * capacity / max(1, total_capacity)


@attrs.frozen
class QueueBalance:
    """What the fair shares of one queue are made of, as read from Redis: the
    one place that turns those reads into :class:`QueueShare` values, for
    :meth:`Client.workers` (``mesh status``) and the dashboard's
    :func:`mesh._view.overview` alike. Sync, no I/O.

    Attributes:
        queue: the queue.
        weight: T, the total weight of its persistent tasks
            (``:weight`` of ``{ns}:share:<Q>``).
        capacity: C, the total capacity of its servers (``:capacity``),
            at least 1.
        incoming: per worker, the persistent tasks on their way to it (marked
            to move to it, or handed back and reserved for it).
        outgoing: per worker, its processes a rebalance asked it to hand back.
    """

    queue: str
    weight: int
    capacity: int
    incoming: Mapping[str, int]
    outgoing: Mapping[str, int]

    @classmethod
    def read(
        cls,
        queue: str,
        weight: bytes | None,
        capacity: bytes | None,
        moving: Mapping[bytes, bytes],
        reserved: Mapping[bytes, bytes],
        holders: Iterable[str],
    ) -> QueueBalance:
        """From the share hash's ``:weight`` and ``:capacity``, the queue's
        ``moving`` and ``reserved`` hashes (values ``R:ms``: for worker R),
        and the worker holding each process in ``moving``."""
        incoming: dict[str, int] = {}
        for v in [*moving.values(), *reserved.values()]:
            to = v.decode().rsplit(":", 1)[0]
            incoming[to] = incoming.get(to, 0) + 1
        outgoing: dict[str, int] = {}
        for holder in holders:
            outgoing[holder] = outgoing.get(holder, 0) + 1
        return cls(queue, int(weight or 0), max(1, int(capacity or 0)), incoming, outgoing)

    def of(self, worker: str, held: int, capacity: bytes | None, extra: bytes | None) -> QueueShare:
        """``worker``'s share, holding ``held`` processes of the queue, with
        its ``c`` + id and ``h`` + id fields of the share hash (its capacity,
        1 when absent; the weight of its processes beyond one each, 0 when
        absent)."""
        cap = int(capacity or 1)
        share = fair_share(self.weight, self.capacity, cap)
        return QueueShare(
            self.queue,
            held,
            math.floor(share),
            math.ceil(share),
            self.incoming.get(worker, 0),
            self.outgoing.get(worker, 0),
            weight=held + int(extra or 0),
            share=share,
            capacity=cap,
        )
