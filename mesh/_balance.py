"""Rebalancing persistent tasks: the decisions, without I/O.

The fair share of a queue's P persistent tasks over its S servers is
``floor(P / S)`` or ``ceil(P / S)`` tasks per worker (the ``P mod S`` workers
holding the most may keep the larger). A worker below ``floor(P / S)`` asks
(``rebalance.lua``) the workers above their share to hand back their surplus,
reserved for it; a worker within one of its share asks nothing. This is the
hysteresis: in a mesh where every worker holds ``floor`` or ``ceil``, nothing
moves, and a task moves only to a worker below its share, never on to a third.

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

__all__ = ["BalancePolicy", "fair_bounds", "pull_count"]


@attrs.frozen
class BalancePolicy:
    """How fast a worker below its share pulls tasks.

    Attributes:
        absolute_limit: at most this many tasks asked for per request.
        relative_limit: and at most this fraction of the queue's persistent
            tasks (at least one).
    """

    absolute_limit: int = 20
    relative_limit: float = 0.1

    def round_limit(self, persistent: int) -> int:
        return max(1, min(self.absolute_limit, math.ceil(self.relative_limit * persistent)))


def fair_bounds(persistent: int, servers: int) -> tuple[int, int]:
    """The least and the most a worker should hold: floor and ceil of
    ``persistent / servers``."""
    s = max(1, servers)
    return persistent // s, -(-persistent // s)


def pull_count(held: int, persistent: int, servers: int, ready: bool, policy: BalancePolicy) -> int:
    """How many tasks a worker holding ``held`` processes of a queue should
    ask for now: 0 unless it holds fewer than the floor of its share and no
    task of the queue is ready to claim."""
    if ready or persistent <= 0:
        return 0
    low, _ = fair_bounds(persistent, servers)
    return max(0, min(low - held, policy.round_limit(persistent)))
