"""The steps of a scenario that check what groups of a queue promise
(protocol/README.md, "Groups"), over the handler runs recorded so far: a
group of concurrency 1 runs its jobs one at a time and in order, across the
whole mesh (``check_serial``), and claims take turns among the groups with
jobs ready (``check_turns``). Both raise :class:`ScenarioFailed` with the
evidence; neither waits, so neither can be cancelled half-way."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ._record import OVERLAP_JITTER, Interval, ScenarioFailed

__all__ = ["check_serial", "check_turns"]


def _runs(intervals: Sequence[Interval], queue: str, tasks: set[str]) -> list[Interval]:
    """The runs of ``tasks`` of ``queue``, in the order they started."""
    return sorted(
        (iv for iv in intervals if iv.queue == queue and iv.task in tasks), key=lambda iv: iv.start
    )


def check_serial(intervals: Sequence[Interval], step: dict[str, Any]) -> None:
    """``{"queue": Q, "tasks": [T, ...]}``: the tasks (the jobs of one group
    of concurrency 1, in the order they were enqueued) each ran, no two runs
    overlapped by more than the harness's reading jitter, on one peer or
    several, and their first runs started in the order given.

    Raises:
        ScenarioFailed: a task never ran, two runs overlapped, or one started
            before a task enqueued ahead of it.
    """
    queue, tasks = step["queue"], [str(t) for t in step["tasks"]]
    runs = _runs(intervals, queue, set(tasks))
    for a, b in itertools.pairwise(runs):
        if b.start < a.end - OVERLAP_JITTER:
            raise ScenarioFailed(
                f"{a.task!r} (peer {a.peer}) and {b.task!r} (peer {b.peer}) of queue {queue} "
                f"ran at once for {min(a.end, b.end) - b.start:.3f} s: their group has "
                "concurrency 1, so at most one of its jobs may run across the mesh"
            )
    first = list(dict.fromkeys(iv.task for iv in runs))
    if first != tasks:
        missing = [t for t in tasks if t not in first]
        if missing:
            raise ScenarioFailed(f"jobs {missing} of queue {queue} never started")
        raise ScenarioFailed(
            f"the jobs of queue {queue} started in the order {first}, not {tasks}: a group of "
            "concurrency 1 runs its jobs in the order they were enqueued"
        )


def check_turns(intervals: Sequence[Interval], step: dict[str, Any]) -> None:
    """``{"queue": Q, "groups": {G: [T, ...], ...}, "rounds": N}`` (and
    ``"quantum"``, 3 by default: the protocol's turn): of the first N x
    (number of groups) starts of these tasks, in every prefix no group has
    started more than ``quantum`` jobs more than another (all groups ready
    from the start, of weight 1: the claim's deficit round-robin gives each
    group a turn of at most ``quantum`` jobs, protocol/README.md "Groups of
    a queue"). A peer that ignores groups starts one group's jobs one after
    the other.

    Raises:
        ScenarioFailed: too few starts, or a prefix in which one group ran
            ahead of another by more than the quantum.
    """
    queue, rounds = step["queue"], int(step["rounds"])
    quantum = int(step.get("quantum", 3))
    group_of = {str(t): g for g, ts in step["groups"].items() for t in ts}
    width = len(step["groups"])
    order = [iv.task for iv in _runs(intervals, queue, set(group_of))]
    if len(order) < rounds * width:
        raise ScenarioFailed(
            f"{len(order)} jobs of queue {queue} started, {rounds * width} expected: {order}"
        )
    counts = dict.fromkeys(step["groups"], 0)
    for i, t in enumerate(order[: rounds * width]):
        counts[group_of[t]] += 1
        if max(counts.values()) - min(counts.values()) > quantum:
            raise ScenarioFailed(
                f"after {order[: i + 1]} of queue {queue} (all: {order}) one group had started "
                f"{max(counts.values()) - min(counts.values())} jobs more than another: claims "
                f"take turns among the groups with jobs ready, at most {quantum} jobs per turn"
            )
