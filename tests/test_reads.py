"""The table of a queue's keys and counts (mesh._reads), without Redis: every
count has its attribute of QueueInfo and its keys in the table, and every look
reads what its counts need, so that a new job state is one row (and its key)."""

from __future__ import annotations

import attrs

from mesh import QueueInfo
from mesh._browse import PAGES, check_state
from mesh._keys import Keys
from mesh._reads import (
    COUNTS,
    INFO,
    JOB_STATES,
    OVERVIEW,
    QUEUE_COUNTS,
    QUEUE_KEYS,
    QueueRead,
    queue_info,
)


def test_every_count_is_an_attribute_of_queue_info_and_back() -> None:
    counted = {c.name for c in QUEUE_COUNTS}
    assert {f.name for f in attrs.fields(QueueInfo)} == {"name", "paused", *counted}
    assert JOB_STATES == tuple(c.name for c in QUEUE_COUNTS if c.state)
    for state in JOB_STATES:
        assert check_state(state) == state
    assert set(PAGES) == set(JOB_STATES)  # a page of each state's jobs


def test_every_look_reads_the_keys_its_counts_need() -> None:
    needed = {k for c in QUEUE_COUNTS for k in c.keys} | {"paused"}
    assert needed <= set(QUEUE_KEYS)
    for read in (INFO, COUNTS, OVERVIEW):
        names = [*read.sizes, *read.wholes]
        assert needed <= set(names), read
        assert len(names) == len(set(names)) == len(read)
    keys = Keys("ns")
    for name, row in QUEUE_KEYS.items():
        assert row.key(keys, "q").startswith("{ns}:"), name


def test_a_count_is_the_same_read_as_a_size_or_whole() -> None:
    """A queue's counts from the sizes of its keys equal those from the keys
    read whole (as the dashboard reads some of them)."""
    wholes = {
        "queue": [b"a", b"b"],
        "prio": [b"5" + b"0" * 15 + b"c"],
        "delayed": [b"d", b"1000", b"e", b"2000", b"f", b"3000"],
        "procs": [b"1", b"rec"],
        "persistent": [b"p1", b"1", b"p2", b""],
        "standby": [b"p3"],
        "dead": [b"x", b"y", b"z", b"w"],
        "grouped": [b":n", b"2", b"r:t1", b"1", b"c:t1", b"1,,,"],
        "gdelayed": [b"t1\0dg", b"4000"],
    }
    read = QueueRead(("paused",), tuple(wholes))
    from_wholes = queue_info("q", read.parse([1, *wholes.values()]))
    rows = [QUEUE_KEYS[k] for k in INFO.sizes[:-1]]
    sizes = INFO.parse(
        [r.count(r.parse(wholes[k])) for r, k in zip(rows, INFO.sizes, strict=False)] + [1]
    )
    assert queue_info("q", sizes) == from_wholes
    assert from_wholes == QueueInfo("q", 5, 4, 1, 3, 4, paused=True)
