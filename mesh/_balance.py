"""Rebalancing persistent tasks: the decisions, without I/O.

The fair share is by weight against capacity (Helix's WAGED idea): a queue's
persistent tasks weigh T in all (each task 1 unless ensured with another
weight), its servers have a total capacity C (each 1 unless served with
another), and worker w's fair share is ``T * capacity(w) / C``: with every
weight and capacity 1, ``P / S``, so that each worker holds ``floor(P / S)``
or ``ceil(P / S)`` tasks.

A worker holding at most its share - 1 (by weight) asks (``rebalance.lua``)
the workers above their share to hand back their surplus, reserved for it; a
worker within one of its share asks nothing. This is the hysteresis: a task
of weight x moves only to a worker that stays at or below its share, from one
that stays above its share - 1, so nothing bounces and nothing goes on to a
third worker; with weights, each worker ends within one task's weight of its
share (a task heavier than any worker's deficit stays where it is).

Which processes move, and from whom, is decided atomically in Redis from
Redis state (``rebalance.lua``); this module decides when a worker asks and
for how many: only when the queue has no task ready to claim (a claim with
the fair share spreads those), at most once per heartbeat (the pace), and at
most :meth:`BalancePolicy.round_limit` tasks per request (like Akka Cluster
Sharding's absolute and relative limits), so a large mesh converges in a few
heartbeats without a storm of hand-backs.
"""

from __future__ import annotations

import math

import attrs

from ._share import MAX_WEIGHT, check_capacity, check_weight, fair_share

__all__ = [
    "MAX_WEIGHT",
    "BalancePolicy",
    "check_capacity",
    "check_weight",
    "fair_bounds",
    "fair_share",
    "pull_count",
]


@attrs.frozen
class BalancePolicy:
    """How fast a worker below its share pulls tasks.

    Attributes:
        absolute_limit: at most this many tasks asked for per request.
        relative_limit: and at most this fraction of the queue's persistent
            tasks (by weight; at least one).
    """

    absolute_limit: int = 20
    relative_limit: float = 0.1

    def round_limit(self, persistent: int) -> int:
        return max(1, min(self.absolute_limit, math.ceil(self.relative_limit * persistent)))


def fair_bounds(total_weight: int, total_capacity: int, capacity: int = 1) -> tuple[int, int]:
    """The least and the most a worker should hold, by weight, with every
    task's weight 1: floor and ceil of its fair share (with heavier tasks, a
    balanced worker is within one task's weight of its share)."""
    share = fair_share(total_weight, total_capacity, capacity)
    return math.floor(share), math.ceil(share)


def pull_count(
    held: int,
    persistent: int,
    servers: int,
    ready: bool,
    policy: BalancePolicy,
    capacity: int = 1,
) -> int:
    """How many tasks a worker holding ``held`` (by weight) of a queue
    whose persistent tasks weigh ``persistent`` in all, served with a total
    capacity of ``servers``, should ask for now: 0 unless it holds at most
    its share - 1 and no task of the queue is ready to claim; else its
    deficit (rounded down), at most the policy's round limit."""
    if ready or persistent <= 0:
        return 0
    deficit = fair_share(persistent, servers, capacity) - held
    if deficit < 1:
        return 0
    return min(math.floor(deficit), policy.round_limit(persistent))
