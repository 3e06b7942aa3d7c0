"""The invariants checked over a run's whole record once its steps are done:
one owner at a time (a stopped peer's time excluded, see :func:`live`),
tokens that grow and never repeat, and no start after a durable cancel."""

from __future__ import annotations

import itertools
import math

from ._record import FENCE_GRACE, OVERLAP_JITTER, Interval, Record


def check(record: Record) -> None:
    """Check every invariant over ``record``; each failure is added to it."""
    by_task: dict[tuple[str, str], list[Interval]] = {}
    for iv in record.intervals:
        by_task.setdefault((iv.queue, iv.task), []).append(iv)
    tokens: dict[int, Interval] = {}
    for iv in record.intervals:
        if iv.token < 0:
            continue  # not a token (reported as a line-protocol failure)
        if iv.token in tokens and tokens[iv.token] is not iv:
            other = tokens[iv.token]
            record.fail(
                "growing tokens",
                f"token {iv.token} given twice: {other.task!r} on {other.peer} and "
                f"{iv.task!r} on {iv.peer}",
            )
        tokens[iv.token] = iv
    for (queue, task), ivs in by_task.items():
        ivs.sort(key=lambda iv: iv.start)
        for a, b in itertools.pairwise(ivs):
            if min(a.token, b.token) >= 0 and b.token <= a.token:
                record.fail(
                    "growing tokens",
                    f"{task!r} of queue {queue}: owner {b.peer} started with token "
                    f"{b.token} after {a.peer}'s token {a.token}",
                )
        for i, a in enumerate(ivs):
            for b in ivs[i + 1 :]:
                both = overlap(record, a, b)
                if both > OVERLAP_JITTER:
                    record.fail(
                        "one owner",
                        f"{task!r} of queue {queue} ran twice at once for {both:.3f} s: "
                        f"on {a.peer} (token {a.token}, {span(record, a)}) and on {b.peer} "
                        f"(token {b.token}, {span(record, b)})",
                    )
        for t_cancel, q, t in record.cancelled:
            if q == queue and t == task:
                for iv in ivs:
                    if iv.start > t_cancel + OVERLAP_JITTER:
                        record.fail(
                            "durable cancel",
                            f"{task!r} of queue {queue} started again on {iv.peer} "
                            f"(token {iv.token}) {iv.start - t_cancel:.3f} s after its cancel",
                        )


def span(record: Record, iv: Interval) -> str:
    """When ``iv`` ran, from the run's start, for evidence."""
    t0 = record.t0
    end = "still running" if iv.end == math.inf else f"{iv.end - t0:.3f} s ({iv.how})"
    return f"from {iv.start - t0:.3f} s to {end}"


def live(record: Record, iv: Interval) -> list[tuple[float, float]]:
    """The parts of ``iv`` when its handler could run: not while its peer
    was stopped (SIGSTOP), and not in the FENCE_GRACE after SIGCONT when
    it then stopped as fenced."""
    end = iv.end if iv.end < math.inf else record.now()
    parts = [(iv.start, end)]
    for p0, p1 in record.peers[iv.peer].paused:
        cut: list[tuple[float, float]] = []
        for s, e in parts:
            if e <= p0 or s >= p1:
                cut.append((s, e))
                continue
            if s < p0:
                cut.append((s, p0))
            if e > p1:
                resumed = p1
                if iv.how == "fenced" and e - resumed <= FENCE_GRACE:
                    continue
                cut.append((p1, e))
        parts = cut
    return parts


def overlap(record: Record, a: Interval, b: Interval) -> float:
    """How long ``a`` and ``b`` ran at once (their :func:`live` parts)."""
    total = 0.0
    for s1, e1 in live(record, a):
        for s2, e2 in live(record, b):
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total
