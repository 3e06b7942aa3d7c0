"""mesh._policy: the stored policy of a queue, parsed, compared and watched.
Parsing is pure; the watch reads a real redis-server (policy_fields and the
value rules are in test_validate.py)."""

from __future__ import annotations

import json
import logging

import anyio
import pytest

from mesh._connection import Connection
from mesh._errors import ProtocolError
from mesh._keys import Keys
from mesh._policy import (
    PolicyWatch,
    QueuePolicy,
    apply_stored,
    differences,
    parse_policy,
    watch_policies,
)
from mesh.testing import wait_until

pytestmark = pytest.mark.both_loops

STORED = {
    "max_attempts": 3,
    "backoff_ms": 250,
    "backoff_max_ms": 4000,
    "timeout_ms": 1500,
    "result_ttl_ms": 60000,
    "rate_limit": 10,
    "rate_period_ms": 2000,
    "source": "configure",
}


def test_parse_policy_turns_ms_into_seconds() -> None:
    p = parse_policy(json.dumps(STORED), "q")
    assert p == QueuePolicy(3, 0.25, 4.0, 1.5, 60.0, 10, 2.0, "configure")
    # protocol 3 stored no rate limit and no source
    old = {k: v for k, v in STORED.items() if not k.startswith("rate") and k != "source"}
    assert parse_policy(json.dumps(old).encode(), "q") == QueuePolicy(3, 0.25, 4.0, 1.5, 60.0)


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        json.dumps({k: v for k, v in STORED.items() if k != "timeout_ms"}),
        json.dumps(STORED | {"max_attempts": "x"}),
        json.dumps(STORED | {"backoff_ms": -1}),
        json.dumps([1, 2]),
    ],
)
def test_a_malformed_policy_is_a_protocol_error_naming_the_queue(raw: bytes | str) -> None:
    with pytest.raises(ProtocolError) as exc:
        parse_policy(raw, "jobs")
    assert str(exc.value).startswith("malformed policy of queue jobs: ")
    assert "\n" not in str(exc.value)


def test_differences_name_each_explicit_option_the_policy_overrides() -> None:
    p = QueuePolicy(max_attempts=3, backoff=0.5)
    assert differences(p, {}) == []
    assert differences(p, {"max_attempts": 3, "backoff": 0.5}) == []
    assert differences(p, {"max_attempts": 5, "backoff": 0.5, "backoff_max": 9.0}) == [
        "max_attempts=5 (the queue's policy says 3)",
        "backoff_max=9.0 (the queue's policy says 60.0)",
    ]


def test_apply_stored_skips_missing_and_logs_malformed(caplog: pytest.LogCaptureFixture) -> None:
    applied: list[tuple[str, QueuePolicy]] = []
    raw = json.dumps(STORED).encode()
    with caplog.at_level(logging.WARNING, logger="mesh.worker"):
        apply_stored(["a", "b", "c"], [raw, None, b"{}"], lambda q, p: applied.append((q, p)))
    assert applied == [("a", parse_policy(raw, "a"))]
    assert [r.getMessage() for r in caplog.records] == [
        "reading the policy of queue c failed: malformed policy of queue c: 'max_attempts'"
    ]
    with pytest.raises(ValueError):  # one reply per queue, or it is a bug
        apply_stored(["a"], [], lambda q, p: None)


def test_a_policy_watch_lists_the_queues_its_runners_name_now() -> None:
    runners: dict[str, object] = {"b": 1, "a": 2}
    watch = PolicyWatch("{ns}:policy", runners, lambda q, p: None)
    assert watch.queues() == ["a", "b"]
    runners["0"] = 3  # a live mapping
    assert watch.queues() == ["0", "a", "b"]


async def test_watch_policies_reads_and_applies_each_interval(
    conn: Connection, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    runners: dict[str, object] = {"a": 1, "b": 1}
    applied: dict[str, QueuePolicy] = {}

    def apply(q: str, p: QueuePolicy) -> None:
        applied[q] = p

    async with anyio.create_task_group() as nursery:
        nursery.start_soon(watch_policies, conn, keys.policy, runners, apply, 0.01)
        await conn.execute("HSET", keys.policy, "a", json.dumps(STORED))
        await wait_until(lambda: "a" in applied, what="a's policy applied")
        assert applied["a"].max_attempts == 3 and "b" not in applied  # b has none
        # an error is logged, and the next interval reads again
        await conn.execute("DEL", keys.policy)
        await conn.execute("SET", keys.policy, "not a hash")
        with caplog.at_level(logging.WARNING, logger="mesh.worker"):
            await wait_until(
                lambda: any("WRONGTYPE" in r.getMessage() for r in caplog.records),
                what="the failed read logged",
            )
        await conn.execute("DEL", keys.policy)
        await conn.execute("HSET", keys.policy, "b", json.dumps(STORED | {"max_attempts": 7}))
        await wait_until(lambda: "b" in applied, what="b's policy applied after the error")
        assert applied["b"].max_attempts == 7
        assert applied["a"].max_attempts == 3  # a cleared policy keeps what it had
        nursery.cancel_scope.cancel()
