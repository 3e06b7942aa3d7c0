"""Each Lua script against a real redis-server: the keys it leaves, its error
codes, and that running it twice is safe."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import anyio
import attrs
import pytest

import mesh
from mesh import ConfigError, ConflictError, FencedError, Process, ProtocolError
from mesh._binding import Binding
from mesh._connection import Connection, open_connection
from mesh._errors import CommandError
from mesh._keys import Keys
from mesh._pubsub import PubSub, open_pubsub
from mesh._replies import _PROCESS_SLOTS, HeartbeatRequest, ResultsToKeep, parse_claim, parse_record
from mesh._scripts import expand_script, load_scripts
from mesh._transport import Packed, pack
from mesh.testing import RedisServer, wait_until

from .helpers import redis_ms
from .protocol_helpers import expire_worker, join, snapshot

Q = "jobs"


async def messages_until_end(conn: Connection, pubsub: PubSub, channel: str) -> list[bytes]:
    """The messages ``pubsub`` got on ``channel`` until now: publishes a
    marker and collects up to it (the marker included)."""
    await conn.execute("PUBLISH", channel, "end")
    got: list[bytes] = []
    with anyio.fail_after(5):
        async for msg in pubsub:
            got.append(msg.data)
            if msg.data == b"end":
                return got
    raise AssertionError("unreachable")


async def test_every_key_carries_the_namespace_hash_tag(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"a"])
    await b.ensure(conn, Q, [b"p"])
    c = await b.claim(conn, "w1", inc, Q, 1, 1)
    await b.give_back(
        conn, "w1", Q, [c.processes[0].id], failed=True, backoff_ms=10_000, backoff_cap_ms=10_000
    )
    names = await conn.execute("KEYS", "*")
    ours = [n.decode() for n in names if n.decode().startswith(keys.prefix)]
    assert len(ours) >= 8
    assert all(n.startswith("{" + keys.namespace + "}:") for n in ours)


async def test_register_refuses_a_duplicate_and_a_foreign_version(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    now = await b.register(conn, "w1", "i1", 5000, b'{"host": "h"}')
    assert now > 1_600_000_000_000
    assert await conn.execute("GET", keys.heartbeat("w1")) == b"i1"
    assert 0 < await conn.execute("PTTL", keys.heartbeat("w1")) <= 5000
    assert await conn.execute("ZSCORE", keys.workers, "w1") == str(now + 5000).encode()
    # the description gets its start time, by the Redis clock, in the same step
    info = json.loads(await conn.execute("HGET", keys.info, "w1"))
    assert info == {"started": round(now / 1000, 3), "host": "h"}
    await b.register(conn, "w0", "i0", 5000, b"{}")
    assert json.loads(await conn.execute("HGET", keys.info, "w0")).keys() == {"started"}
    with pytest.raises(ConfigError, match="in use"):
        await b.register(conn, "w1", "i2", 5000, b"{}")
    # dead but not yet recycled: still refused
    await expire_worker(conn, keys, "w1")
    with pytest.raises(ConfigError, match="in use"):
        await b.register(conn, "w1", "i2", 5000, b"{}")
    await conn.execute("SET", keys.version, "999")
    with pytest.raises(ProtocolError, match="version 999"):
        await b.register(conn, "w2", "i", 5000, b"{}")
    with pytest.raises(CommandError) as e:
        await b.register(conn, "w3", "i", 0, b"{}")
    assert e.value.code == "BAD_ARG"


async def test_enqueue_appends_in_order_and_publishes_work(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    assert await b.enqueue(conn, Q, [b"a", b"", b"\x00\xff"]) == 3
    assert await b.enqueue(conn, Q, [b"d"]) == 4
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"a", b"", b"\x00\xff", b"d"]
    assert await conn.execute("SMEMBERS", keys.queues) == [Q.encode()]


async def test_enqueue_of_a_persistent_payload_changes_nothing(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await b.ensure(conn, Q, [b"dev-1"])
    with pytest.raises(ConflictError, match="task 1 of this call"):
        await b.enqueue(conn, Q, [b"x", b"dev-1"])
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"dev-1"]
    # running: still a persistent task of Q
    inc = await join(b, conn, "w1", Q)
    await b.claim(conn, "w1", inc, Q, 1, 0)
    with pytest.raises(ConflictError, match="task 0 of this call"):
        await b.enqueue(conn, Q, [b"dev-1"])
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == []


async def test_ensure_of_a_one_shot_payload_changes_nothing(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await b.enqueue(conn, Q, [b"job-1", b"job-2"])
    with pytest.raises(ConflictError, match="task 1 of this call is a one-shot task"):
        await b.ensure(conn, Q, [b"dev", b"job-2"])
    # many payloads at once take the one-pass path: the same answer
    many = [b"d%d" % i for i in range(20)] + [b"job-1"]
    with pytest.raises(ConflictError, match="task 20 of this call"):
        await b.ensure(conn, Q, many)
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"job-1", b"job-2"]
    assert await conn.execute("HLEN", keys.persistent(Q)) == 0
    assert await conn.execute("SCARD", keys.standby(Q)) == 0
    # waiting for a retry: still a one-shot task of Q
    inc = await join(b, conn, "w1", Q)
    (p,) = (await b.claim(conn, "w1", inc, Q, 1, 0)).processes
    await b.give_back(conn, "w1", Q, [p.id], failed=True, backoff_ms=60_000, backoff_cap_ms=60_000)
    assert await conn.execute("ZSCORE", keys.delayed(Q), b"job-1") is not None
    with pytest.raises(ConflictError, match="task 0 of this call"):
        await b.ensure(conn, Q, [b"job-1"])
    # a persistent copy queued alongside is no conflict, nor another queue
    assert await b.ensure(conn, Q, [b"dev"]) == [True]
    assert await b.ensure(conn, Q, many[:20]) == [True] * 20
    assert await b.ensure(conn, Q, [b"dev", b"d3"]) == [False, False]
    assert await b.ensure(conn, "other", [b"job-2"]) == [True]


async def test_ensure_of_a_running_one_shot_payload_changes_nothing(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    """Running is the third place a one-shot task can be (issue 27): ensuring
    it then would run the payload twice, once of each kind."""
    await b.enqueue(conn, Q, [b"job\x00-1"], 3)  # a priority, and a NUL in the payload
    await b.enqueue(conn, Q, [b"job-2"])
    inc = await join(b, conn, "w1", Q)
    ps = (await b.claim(conn, "w1", inc, Q, 2, 0)).processes
    assert {p.task for p in ps} == {b"job-2", b"job\x00-1"}
    assert await conn.execute("LLEN", keys.queue(Q)) == 0
    with pytest.raises(ConflictError, match="task 1 of this call runs as a one-shot task"):
        await b.ensure(conn, Q, [b"dev", b"job-2"])
    with pytest.raises(ConflictError, match="task 0 of this call runs as a one-shot task"):
        await b.ensure(conn, Q, [b"job\x00-1"])
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == []
    assert await conn.execute("HLEN", keys.persistent(Q)) == 0
    assert await conn.execute("SCARD", keys.standby(Q)) == 0
    # a suffix of a running payload, or the same payload in another queue, is no conflict
    assert await b.ensure(conn, Q, [b"-2", b"b-2"]) == [True, True]
    assert await b.ensure(conn, "other", [b"job-2"]) == [True]
    # finished: the payload is free to become persistent
    await b.finish(conn, "w1", inc, Q, [p.id for p in ps if p.task == b"job-2"])
    assert await b.ensure(conn, Q, [b"job-2"]) == [True]


async def test_ensure_again_while_a_cancelled_persistent_process_exits(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await b.ensure(conn, Q, [b"dev"])
    inc = await join(b, conn, "w1", Q)
    (p,) = (await b.claim(conn, "w1", inc, Q, 1, 0)).processes
    await b.cancel(conn, Q, b"dev")
    # its record may still be there while its handler exits: not a one-shot task
    assert await b.ensure(conn, Q, [b"dev"]) == [True]
    assert p.persistent


async def test_ensure_is_unique_per_queue_and_payload(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    assert await b.ensure(conn, Q, [b"p1", b"p1", b"p2"]) == [True, False, True]
    assert await b.ensure(conn, Q, [b"p1"]) == [False]
    assert await b.ensure(conn, "other", [b"p1"]) == [True]
    s = await snapshot(conn, keys, Q, [])
    assert s["queue"] == [b"p1", b"p2"] and s["standby"] == {b"p1", b"p2"}
    assert s["persistent"] == {}
    inc = await join(b, conn, "w1", Q)
    await b.claim(conn, "w1", inc, Q, 10, 0)
    assert await b.ensure(conn, Q, [b"p1", b"p2"]) == [False, False]  # running
    s = await snapshot(conn, keys, Q, ["w1"])
    assert s["queue"] == [] and s["standby"] == set()
    assert set(s["persistent"]) == {b"p1", b"p2"}


async def test_claim_makes_processes_with_increasing_tokens(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"a", b"b", b"c"])
    await b.ensure(conn, Q, [b"p"])
    r = await b.claim(conn, "w1", inc, Q, 3, 4)
    assert [p.task for p in r.processes] == [b"a", b"b", b"c"]
    assert r.remaining == 1
    assert (await snapshot(conn, keys, Q, []))["standby"] == {b"p"}
    tokens = [p.token for p in r.processes]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert all(
        p.id == str(p.token) and p.worker_id == "w1" and not p.persistent for p in r.processes
    )
    r2 = await b.claim(conn, "w1", inc, Q, 3, 4)
    (p,) = r2.processes
    assert p.persistent and p.task == b"p" and p.token > max(tokens)
    assert r2.remaining == 0
    s = await snapshot(conn, keys, Q, ["w1"])
    assert s["held"]["w1"] == {x.id for x in (*r.processes, p)}
    assert s["persistent"] == {b"p": p.id.encode()} and s["standby"] == set()
    rec = parse_record(p.id.encode(), s["procs"][p.id.encode()], Q)
    assert rec == p
    assert (await b.claim(conn, "w1", inc, Q, 3, 4)).processes == ()


@pytest.mark.parametrize(
    "counter",
    [
        str(2**53 + 2),  # 2^53 + 3 is no double: a Lua number + 1 gave 2^53 + 4 twice
        "99999999999999999998",  # twenty digits: carries into a twenty-first
    ],
)
async def test_claimed_tokens_are_exact_past_2_to_the_53(
    conn: Connection, b: Binding, keys: Keys, counter: str
) -> None:
    """Tokens are worked on as decimal strings in claim.lua: past 2^53 a
    counter + 1 in a Lua number rounds, and two claims handed out one token
    twice. Each claim's ids follow the counter exactly, and never repeat."""
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"t%d" % i for i in range(6)])
    await conn.execute("SET", keys.token, counter)
    first = (await b.claim(conn, "w1", inc, Q, 3, 7)).processes
    second = (await b.claim(conn, "w1", inc, Q, 3, 7)).processes
    ids = [p.id for p in (*first, *second)]
    expected = [str(int(counter) + 1 + i) for i in range(6)]
    assert ids == expected
    assert [p.token for p in (*first, *second)] == [int(i) for i in expected]
    assert await conn.execute("GET", keys.token) == ids[-1].encode()


async def test_claimed_ids_carry_across_hundreds_and_records_keep_the_claims_fields(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    # claim.lua writes the last two digits of each id from a table, not with
    # string.format: the ids of one claim cross ...99 -> ...00 correctly
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"t%d" % i for i in range(5)])
    await conn.execute("SET", keys.token, "4999999999999997")
    r = await b.claim(conn, "w1", inc, Q, 5, 7, backoff_ms=250, backoff_cap_ms=9000, ttl_ms=3000)
    ids = [p.id for p in r.processes]
    assert ids == [str(4999999999999998 + i) for i in range(5)]
    assert await conn.execute("GET", keys.token) == ids[-1].encode()
    s = await snapshot(conn, keys, Q, ["w1"])
    assert s["held"]["w1"] == set(ids)
    rec = s["procs"][ids[0].encode()].split(b"\0", 8)
    assert rec[:7] == [b"w1", b"o", b"0", b"7", b"250", b"9000", b"3000"]
    assert rec[8] == b"t0" and int(rec[7]) == r.now_ms
    assert await b.finish(conn, "w1", inc, Q, ids) == [True] * 5
    assert await conn.execute("HLEN", keys.procs(Q)) == 0


async def test_a_finish_of_more_than_a_thousand_ids_reads_them_in_chunks(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    # finish.lua passes up to 1,000 ids to one HMGET, more in chunks
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"t%d" % i for i in range(1200)])
    ids = [p.id for p in (await b.claim(conn, "w1", inc, Q, 1000, 0)).processes]
    ids += [p.id for p in (await b.claim(conn, "w1", inc, Q, 1000, 0)).processes]
    assert len(ids) == 1200
    done = await b.finish(conn, "w1", inc, Q, [*ids, ids[0], "1"])
    assert done == [True] * 1200 + [False, False]
    assert await conn.execute("HLEN", keys.procs(Q)) == 0
    assert await b.finish(conn, "w1", inc, Q, []) == []


async def test_claim_checks_lease_serving_and_arguments(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"a"])
    with pytest.raises(FencedError, match="superseded"):
        await b.claim(conn, "w1", "wrong", Q, 1, 0)
    with pytest.raises(CommandError) as e:
        await b.claim(conn, "w1", inc, "unserved", 1, 0)
    assert e.value.code == "NOT_SERVING"
    for bad in (0, 1001, -1):
        with pytest.raises(CommandError) as e:
            await b.claim(conn, "w1", inc, Q, bad, 0)
        assert e.value.code == "BAD_ARG"
    await expire_worker(conn, keys, "w1")
    with pytest.raises(FencedError, match="no lease"):
        await b.claim(conn, "w1", inc, Q, 1, 0)
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"a"]


async def test_finish_reports_true_once_and_never_for_a_stranger(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    i1 = await join(b, conn, "w1", Q)
    i2 = await join(b, conn, "w2", Q)
    await b.enqueue(conn, Q, [b"a"])
    await b.ensure(conn, Q, [b"p"])
    (a, p) = (await b.claim(conn, "w1", i1, Q, 2, 0)).processes
    assert await b.finish(conn, "w2", i2, Q, [a.id]) == [False]  # not w2's
    assert await b.finish(conn, "w1", "stale", Q, [a.id]) == [False]  # wrong incarnation
    assert await b.finish(conn, "w1", i1, Q, [a.id, p.id, "999"]) == [True, True, False]
    assert await b.finish(conn, "w1", i1, Q, [a.id, p.id]) == [False, False]  # twice: no change
    s = await snapshot(conn, keys, Q, ["w1"])
    assert s["procs"] == {} and s["held"]["w1"] == set()
    assert s["persistent"] == {} and s["standby"] == set()


async def test_give_back_return_puts_tasks_at_the_front_in_claim_order(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"a", b"b", b"c"])
    (a, bb) = (await b.claim(conn, "w1", inc, Q, 2, 0)).processes
    out = await b.give_back(conn, "w1", Q, [bb.id, a.id], failed=False)
    assert out == [(1, 0), (1, 0)]
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"a", b"b", b"c"]
    assert await b.give_back(conn, "w1", Q, [a.id], failed=False) == [(0, 0)]  # twice
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"a", b"b", b"c"]


async def test_failed_one_shot_tasks_back_off_then_go_to_dead_letters(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"poison"])
    delays = []
    for _ in range(2):
        (p,) = (await b.claim(conn, "w1", inc, Q, 1, 3)).processes
        [(outcome, delay)] = await b.give_back(
            conn, "w1", Q, [p.id], failed=True, backoff_ms=5, backoff_cap_ms=7
        )
        assert outcome == 2
        delays.append(delay)
        s = await snapshot(conn, keys, Q, ["w1"])
        assert s["delayed"] == [b"poison"] and s["queue"] == []
        # make it due now (forced, not slept)
        await conn.execute("ZADD", keys.delayed(Q), 0, b"poison")
    assert delays == [5, 7]  # base, then doubled and capped
    (p,) = (await b.claim(conn, "w1", inc, Q, 1, 3)).processes
    assert p.attempts == 2
    assert await b.give_back(
        conn, "w1", Q, [p.id], failed=True, backoff_ms=5, backoff_cap_ms=7
    ) == [(3, 0)]
    s = await snapshot(conn, keys, Q, ["w1"])
    assert (
        s["dead"] == [b"poison"] and s["delayed"] == [] and s["attempts"] == {} and s["procs"] == {}
    )


async def test_zero_backoff_retries_at_the_back(conn: Connection, b: Binding, keys: Keys) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"x", b"y"])
    (x,) = (await b.claim(conn, "w1", inc, Q, 1, 0)).processes
    assert await b.give_back(conn, "w1", Q, [x.id], failed=True) == [(2, 0)]
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"y", b"x"]


async def test_failed_persistent_task_backs_off_without_limit(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.ensure(conn, Q, [b"dev"])
    for _ in range(4):
        await conn.execute("ZADD", keys.delayed(Q), "XX", 0, b"dev")  # due now, if delayed
        (p,) = (await b.claim(conn, "w1", inc, Q, 1, 1)).processes
        assert p.persistent
        [(outcome, _)] = await b.give_back(
            conn, "w1", Q, [p.id], failed=True, backoff_ms=100, backoff_cap_ms=60_000
        )
        assert outcome == 2
    s = await snapshot(conn, keys, Q, ["w1"])
    assert s["dead"] == [] and s["delayed"] == [b"dev"]
    assert s["persistent"] == {} and s["standby"] == {b"dev"}
    assert await b.ensure(conn, Q, [b"dev"]) == [False]


async def test_heartbeat_renews_reports_inbox_and_queue_states(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q, "empty", "later", ttl_ms=1000)
    await b.enqueue(conn, Q, [b"a"])
    await conn.execute("ZADD", keys.delayed("later"), 10**15, b"x")  # far future
    (_,) = (await b.claim(conn, "w1", inc, Q, 1, 0)).processes
    await b.enqueue(conn, Q, [b"b"])
    hb = await b.heartbeat(conn, "w1", inc, 5000, [], [Q, "empty", "later"])
    assert hb.queue_states[:2] == (0, -1) and hb.queue_states[2] > 10**9
    assert hb.held == (1, 0, 0)  # what Redis says w1 holds, per queue
    assert hb.idle == (False, False, False) and hb.idle_servers == (0, 0, 0)
    await join(b, conn, "w2", "empty")
    assert (await b.claim(conn, "w1", inc, "empty", 1, 0)).processes == ()
    assert (await b.claim(conn, "w2", "inc-w2", "empty", 1, 0)).processes == ()
    hb = await b.heartbeat(conn, "w1", inc, 5000, [], [Q, "empty", "later"])
    assert hb.idle == (False, True, False) and hb.idle_servers == (0, 2, 0)
    assert 4000 < await conn.execute("PTTL", keys.heartbeat("w1")) <= 5000
    assert int(await conn.execute("ZSCORE", keys.workers, "w1")) == hb.now_ms + 5000
    await conn.execute("SADD", keys.inbox("w1"), "7", "8")
    hb = await b.heartbeat(conn, "w1", inc, 5000, [], [])
    assert sorted(hb.inbox) == ["7", "8"]
    hb = await b.heartbeat(conn, "w1", inc, 5000, ["7"], [])  # acked ones go
    assert hb.inbox == ("8",)
    with pytest.raises(FencedError, match="superseded"):
        await b.heartbeat(conn, "w1", "other", 5000, [], [])
    await expire_worker(conn, keys, "w1")
    with pytest.raises(FencedError, match="no lease"):
        await b.heartbeat(conn, "w1", inc, 5000, [], [])
    assert await conn.execute("EXISTS", keys.heartbeat("w1")) == 0  # not revived


async def test_one_heartbeat_call_renews_many_workers_each_fenced_on_its_own(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    """A fleet's batched renewal: a worker whose lease is gone, or taken over,
    gets its own FENCED and nothing of it is written; the others of the same
    call are renewed and get their own inbox, held count and idle flag."""
    incs = {w: await join(b, conn, w, Q, ttl_ms=1000) for w in ("a", "b", "c", "d")}
    await join(b, conn, "e", "other", ttl_ms=1000)
    await b.ensure(conn, Q, [b"p1", b"p2"])
    (held,) = (await b.claim(conn, "b", incs["b"], Q, 1, 0)).processes
    assert (await b.claim(conn, "d", incs["d"], Q, 1, 0)).processes != ()
    assert (await b.claim(conn, "a", incs["a"], Q, 1, 0)).processes == ()  # idle
    await conn.execute("SADD", keys.inbox("b"), held.id)
    await expire_worker(conn, keys, "c")
    await conn.execute("SET", keys.heartbeat("d"), "someone-else", "PX", 700)
    reqs = [
        HeartbeatRequest(w, incs.get(w, "inc-e"), (), ("other",) if w == "e" else (Q,))
        for w in ("a", "b", "c", "d", "e")
    ]
    out = await b.heartbeat_many(conn, 5000, reqs)
    a, bb, e = out[0].unwrap(), out[1].unwrap(), out[4].unwrap()
    with pytest.raises(FencedError, match="no lease"):
        out[2].unwrap()
    with pytest.raises(FencedError, match="superseded"):
        out[3].unwrap()
    assert (a.inbox, a.held, a.idle, a.persistent, a.servers) == ((), (0,), (True,), (2,), (4,))
    assert (bb.inbox, bb.held, bb.idle) == ((held.id,), (1,), (False,))
    assert (e.inbox, e.held, e.servers) == ((), (0,), (1,))
    for w in ("a", "b", "e"):
        assert 4000 < await conn.execute("PTTL", keys.heartbeat(w)) <= 5000
        assert int(await conn.execute("ZSCORE", keys.workers, w)) == a.now_ms + 5000
    assert await conn.execute("EXISTS", keys.heartbeat("c")) == 0  # not revived
    assert await conn.execute("PTTL", keys.heartbeat("d")) <= 700  # not renewed
    assert int(await conn.execute("ZSCORE", keys.workers, "c")) == 0
    # acknowledged cancels leave the inbox; the single-worker call is the same script
    hb = await b.heartbeat(conn, "b", incs["b"], 5000, [held.id], [Q])
    assert hb.inbox == () and hb.held == (1,)


async def test_batched_heartbeat_answers_each_worker_in_order_around_fenced_ones(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    """The script reads the idle sets, inboxes and held sets of all the
    call's workers at once, fenced ones included, and answers each live
    worker from those reads in order: a fenced worker between live ones,
    workers of two queues and of one, an inbox emptied by the call's own
    acks, another inbox, and a held task must each land on their worker."""
    ws = ("a", "x", "b", "c", "y", "d")
    incs = {w: await join(b, conn, w, Q, "other") for w in ws}
    await b.ensure(conn, Q, [b"p1"])
    assert len((await b.claim(conn, "c", incs["c"], Q, 1, 0)).processes) == 1
    for w in ("a", "b", "d", "x"):  # idle on Q (c holds, y never claimed)
        assert (await b.claim(conn, w, incs[w], Q, 1, 0)).processes == ()
    assert (await b.claim(conn, "b", incs["b"], "other", 1, 0)).processes == ()
    await conn.execute("SADD", keys.inbox("a"), "7")  # acked by this call
    await conn.execute("SADD", keys.inbox("d"), "8", "9")
    await expire_worker(conn, keys, "x")  # fenced, before live workers
    await conn.execute("SET", keys.heartbeat("y"), "someone-else", "PX", 60_000)
    reqs = [
        HeartbeatRequest("a", incs["a"], ("7",), (Q,)),
        HeartbeatRequest("x", incs["x"], (), (Q, "other")),
        HeartbeatRequest("b", incs["b"], (), ("other", Q)),
        HeartbeatRequest("c", incs["c"], (), (Q,)),
        HeartbeatRequest("y", incs["y"], (), (Q,)),
        HeartbeatRequest("d", incs["d"], (), (Q,)),
    ]
    out = await b.heartbeat_many(conn, 5000, reqs)
    with pytest.raises(FencedError, match="no lease"):
        out[1].unwrap()
    with pytest.raises(FencedError, match="superseded"):
        out[4].unwrap()
    a, bb, c, d = (out[i].unwrap() for i in (0, 2, 3, 5))
    assert (a.inbox, a.held, a.idle) == ((), (0,), (True,))
    assert (bb.inbox, bb.held, bb.idle) == ((), (0, 0), (True, True))
    assert (c.inbox, c.held, c.idle) == ((), (1,), (False,))
    assert (sorted(d.inbox), d.held, d.idle) == (["8", "9"], (0,), (True,))
    assert a.idle_servers == (4,) and bb.idle_servers == (1, 4)  # x is still in Q's
    assert await conn.execute("SMEMBERS", keys.inbox("a")) == []
    for w in ("a", "b", "c", "d"):
        assert 4000 < await conn.execute("PTTL", keys.heartbeat(w)) <= 5000
        assert int(await conn.execute("ZSCORE", keys.workers, w)) == a.now_ms + 5000
    assert await conn.execute("PTTL", keys.heartbeat("y")) > 5000  # not renewed


async def test_recycle_touches_only_the_dead_workers_processes(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    i1 = await join(b, conn, "w1", Q, "q2")
    i2 = await join(b, conn, "w2", Q)
    await b.enqueue(conn, Q, [b"a", b"b", b"c", b"d"])
    await b.ensure(conn, Q, [b"p"])
    await b.enqueue(conn, "q2", [b"z"])
    w1 = (await b.claim(conn, "w1", i1, Q, 2, 0)).processes  # a, b
    w2 = (await b.claim(conn, "w2", i2, Q, 2, 0)).processes  # c, d
    (p,) = (await b.claim(conn, "w1", i1, Q, 1, 0)).processes  # persistent p
    (z,) = (await b.claim(conn, "w1", i1, "q2", 1, 0)).processes
    assert p.persistent
    # alive: refused, nothing changes
    r = await b.recycle(conn, "w1", leave=False)
    assert r.alive
    await expire_worker(conn, keys, "w1")
    r = await b.recycle(conn, "w1", leave=False)  # learns its queues from the script
    assert (r.alive, r.returned, r.dead_lettered) == (False, 4, 0)
    s = await snapshot(conn, keys, Q, ["w1", "w2"])
    assert s["queue"] == [b"a", b"b", b"p"]  # front, in claim order
    assert s["held"]["w2"] == {x.id for x in w2}  # the live peer keeps its own
    assert set(s["procs"]) == {x.id.encode() for x in w2}
    assert s["persistent"] == {} and s["standby"] == {b"p"}
    assert s["attempts"] == {b"a": b"1", b"b": b"1", b"p": b"1"}  # a crash counts
    assert await conn.execute("LRANGE", keys.queue("q2"), 0, -1) == [b"z"]
    assert await conn.execute("ZSCORE", keys.workers, "w1") is None
    assert await conn.execute("EXISTS", keys.serves("w1"), keys.info) == 1  # info holds w2 only
    assert await conn.execute("HEXISTS", keys.info, "w1") == 0
    # twice: nothing more
    r = await b.recycle(conn, "w1", leave=False)
    assert (r.alive, r.returned) == (False, 0)
    assert await snapshot(conn, keys, Q, ["w1", "w2"]) == s
    # the dead worker's late calls change nothing
    assert await b.finish(conn, "w1", i1, Q, [w1[0].id, z.id]) == [False, False]
    assert await b.give_back(conn, "w1", Q, [w1[0].id], failed=False) == [(0, 0)]


async def watch_wakes(pubsub: PubSub, keys: Keys, workers: list[str]) -> None:
    """Subscribe ``pubsub`` to the wake channels of ``workers`` and the end
    marker's, sharded as workers do: the scripts ``SPUBLISH`` wakes on Redis
    7.0+ (no pattern subscription hears those), ``PUBLISH`` on 6.2."""
    names = [keys.wake_channel(w) for w in [*workers, "end-marker"]]
    await pubsub.subscribe(*names, sharded=True)


async def wakes_until_end(conn: Connection, pubsub: PubSub, keys: Keys) -> list[tuple[str, bytes]]:
    """(worker, message) of every wake ``pubsub`` (see :func:`watch_wakes`)
    got until now."""
    got = await messages_until_end_p(conn, pubsub, keys.wake_channel("end-marker"))
    return [(ch.decode().removeprefix(keys.wake_prefix), data) for ch, data in got]


async def messages_until_end_p(
    conn: Connection, pubsub: PubSub, channel: str
) -> list[tuple[bytes, bytes]]:
    await conn.execute("PUBLISH", channel, "end")
    got: list[tuple[bytes, bytes]] = []
    with anyio.fail_after(5):
        async for msg in pubsub:
            if msg.data == b"end" and msg.channel == channel.encode():
                return got
            got.append((msg.channel, msg.data))
    raise AssertionError("unreachable")


async def idle(conn: Connection, keys: Keys, q: str) -> set[str]:
    return {w.decode() for w in await conn.execute("SMEMBERS", keys.idle(q))}


async def test_recycle_takes_several_dead_workers_and_wakes_idle_servers_once(
    conn: Connection, b: Binding, keys: Keys, redis_url: str
) -> None:
    incs = {w: await join(b, conn, w, Q) for w in ("w1", "w2", "w3", "w4")}
    await b.ensure(conn, Q, [b"p%d" % i for i in range(8)])
    for w, inc in incs.items():
        assert len((await b.claim(conn, w, inc, Q, 2, 0)).processes) == 2
    # nine idle servers: they found nothing
    for i in range(9):
        inc = await join(b, conn, f"i{i}", Q)
        assert (await b.claim(conn, f"i{i}", inc, Q, 1, 0)).processes == ()
    assert await idle(conn, keys, Q) == {f"i{i}" for i in range(9)}
    for w in ("w1", "w2", "w3"):
        await expire_worker(conn, keys, w)
    async with open_pubsub(redis_url) as pubsub:
        await watch_wakes(pubsub, keys, [*incs, *(f"i{i}" for i in range(9))])
        # w4 is alive: left alone and named; the hint misses Q: learnt
        r = await b.recycle_dead(conn, ["w1", "w2", "w3", "w4"])
        got = await wakes_until_end(conn, pubsub, keys)
    assert (r.recycled, r.alive, r.returned, r.dead_lettered) == (3, ["w4"], 6, 0)
    assert r.queues == [Q]
    # six tasks back: seven idle servers woken (one spare), each once, and
    # taken out of the idle set; the other two stay in it
    woken = [w for w, _ in got]
    assert len(woken) == 7 and len(set(woken)) == 7 and {m for _, m in got} == {Q.encode()}
    assert await idle(conn, keys, Q) == {f"i{i}" for i in range(9)} - set(woken)
    s = await snapshot(conn, keys, Q, ["w1", "w2", "w3", "w4"])
    assert len(s["queue"]) == 6 and len(s["held"]["w4"]) == 2
    assert [s["held"][w] for w in ("w1", "w2", "w3")] == [set(), set(), set()]
    assert set(await conn.execute("ZRANGE", keys.workers, 0, -1)) == {b"w4"} | {
        f"i{i}".encode() for i in range(9)
    }
    # twice: nobody left to recycle, nothing published, nothing changed
    again = await b.recycle_dead(conn, ["w1", "w2", "w3"], queues=[Q])
    assert (again.recycled, again.returned) == (0, 0)
    assert await snapshot(conn, keys, Q, ["w1", "w2", "w3", "w4"]) == s


async def test_idle_servers_are_woken_by_ready_tasks_and_only_they(
    conn: Connection, b: Binding, keys: Keys, redis_url: str
) -> None:
    i1, i2, i3 = [await join(b, conn, w, Q) for w in ("w1", "w2", "w3")]
    async with open_pubsub(redis_url) as pubsub:
        await watch_wakes(pubsub, keys, ["w1", "w2", "w3"])
        # w1 found nothing: idle. A claim by hand (w2) is never woken; w3
        # has not claimed.
        assert (await b.claim(conn, "w1", i1, Q, 2, 0)).processes == ()
        assert (await b.claim(conn, "w2", i2, Q, 2, 0, wake=False)).processes == ()
        assert await idle(conn, keys, Q) == {"w1"}
        await b.enqueue(conn, Q, [b"a", b"b", b"c"])
        assert await wakes_until_end(conn, pubsub, keys) == [("w1", Q.encode())]
        assert await idle(conn, keys, Q) == set()
        # w1 takes all it asked for: not idle (it claims again when a slot
        # frees); w3 takes fewer than it asked for: idle
        p1 = (await b.claim(conn, "w1", i1, Q, 2, 0)).processes
        assert len(p1) == 2 and await idle(conn, keys, Q) == set()
        assert len((await b.claim(conn, "w3", i3, Q, 5, 0)).processes) == 1
        assert await idle(conn, keys, Q) == {"w3"}
        # tasks made ready by a give-back, an ensure, a leaving server wake it
        await b.give_back(conn, "w1", Q, [p1[0].id], failed=False)
        assert await wakes_until_end(conn, pubsub, keys) == [("w3", Q.encode())]
        assert (await b.claim(conn, "w3", i3, Q, 5, 0)).processes != ()
        assert await idle(conn, keys, Q) == {"w3"}
        await b.ensure(conn, Q, [b"d"])
        assert await wakes_until_end(conn, pubsub, keys) == [("w3", Q.encode())]
        assert len((await b.claim(conn, "w3", i3, Q, 5, 0)).processes) == 1
        assert await b.unserve(conn, "w1", Q) == 1  # hands p1[1] back
        assert await wakes_until_end(conn, pubsub, keys) == [("w3", Q.encode())]
        # nothing made ready, nobody woken
        assert len((await b.claim(conn, "w3", i3, Q, 5, 0)).processes) == 1
        assert await idle(conn, keys, Q) == {"w3"}
        await b.enqueue(conn, Q, [])
        assert await wakes_until_end(conn, pubsub, keys) == []
        # a server that stops serving or dies leaves the idle set
        assert await b.unserve(conn, "w3", Q) >= 1
        assert await idle(conn, keys, Q) == set()
        assert len((await b.claim(conn, "w2", i2, Q, 10, 0)).processes) == 4
        assert await idle(conn, keys, Q) == {"w2"}
        await expire_worker(conn, keys, "w2")
        await b.recycle(conn, "w2", leave=False)
        assert await idle(conn, keys, Q) == set()


async def test_a_held_back_claim_passes_the_wake_on(
    conn: Connection, b: Binding, keys: Keys, redis_url: str
) -> None:
    ia, ib = await join(b, conn, "wa", Q), await join(b, conn, "wb", Q)
    await b.ensure(conn, Q, [b"d1", b"d2", b"d3", b"d4"])
    for w, inc in (("wa", ia), ("wb", ib)):
        assert len((await b.claim(conn, w, inc, Q, 2, 0, fair=True)).processes) == 2
    await b.ensure(conn, Q, [b"d5"])  # nobody idle: nobody woken
    await join(b, conn, "wd", Q)
    # wd is an idle server (it found nothing earlier), under its share of
    # ceil(5 / 3) = 2; the wake for d5 went to wa, which is at its share
    await conn.execute("SADD", keys.idle(Q), "wd")
    async with open_pubsub(redis_url) as pubsub:
        await watch_wakes(pubsub, keys, ["wa", "wb", "wd"])
        r = await b.claim(conn, "wa", ia, Q, 10, 0, fair=True)
        assert r.processes == () and r.held_back
        assert await wakes_until_end(conn, pubsub, keys) == [("wd", Q.encode())]
    assert await idle(conn, keys, Q) == set()  # wd was taken out, wa left
    r = await b.claim(conn, "wd", "inc-wd", Q, 10, 0, fair=True)
    assert [p.task for p in r.processes] == [b"d5"]


async def test_an_enqueue_refused_by_the_acl_adds_nothing(own_redis: RedisServer) -> None:
    """The wake comes before the first write: a user whose ACL lacks SPOP
    (an ACL written for protocol 2) gets an error and the queue is as it
    was, so a retry cannot add the tasks twice. Every server we support
    answers such a refusal inside a script with code ``ERR``, each in its own
    words (Redis 7: "The user executing the script can't run this command";
    Valkey 9: "ACL failure in script: User old has no permissions to run the
    'spop' command"), so it is a plain CommandError, told by its code."""
    keys = Keys("acl")
    b = Binding(keys)
    async with open_connection(own_redis.url) as admin:
        await admin.execute("ACL", "SETUSER", "old", "on", ">pw", "~*", "&*", "+@all", "-spop")
        url = f"redis://old:pw@127.0.0.1:{own_redis.port}"
        async with open_connection(url) as conn:
            with pytest.raises(CommandError) as info:
                await b.enqueue(conn, Q, [b"a", b"b"])
        assert type(info.value) is CommandError and info.value.code == "ERR", info.value
        assert await admin.execute("LLEN", keys.queue(Q)) == 0


async def test_a_server_held_back_by_the_fair_share_is_not_idle(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    ia, ib = await join(b, conn, "wa", Q), await join(b, conn, "wb", Q)
    await b.ensure(conn, Q, [b"d1", b"d2", b"d3", b"d4"])
    r = await b.claim(conn, "wa", ia, Q, 10, 0, fair=True)
    assert len(r.processes) == 2 and r.held_back
    assert await idle(conn, keys, Q) == set()  # it retries by itself
    r = await b.claim(conn, "wb", ib, Q, 10, 0, fair=True)
    assert len(r.processes) == 2 and not r.held_back
    assert await idle(conn, keys, Q) == {"wb"}


async def test_recycle_leaves_one_worker_at_a_time(b: Binding, conn: Connection) -> None:
    # loaded here: the EVALSHA below must not depend on an earlier test's calls
    await conn.execute("SCRIPT", "LOAD", b.scripts["recycle"].source)
    with pytest.raises(CommandError, match="BAD_ARG"):
        await conn.execute(
            "EVALSHA", b.scripts["recycle"].sha, 8, *(["k"] * 8), "leave", "i", "p", 2, "a", "b"
        )


async def test_recycle_dead_letters_a_task_that_keeps_killing_workers(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await b.enqueue(conn, Q, [b"poison"])
    for n in range(3):
        w = f"w{n}"
        inc = await join(b, conn, w, Q)
        await conn.execute("ZADD", keys.delayed(Q), "XX", 0, b"poison")  # due now, if delayed
        (p,) = (await b.claim(conn, w, inc, Q, 1, 3)).processes
        assert p.attempts == n
        await expire_worker(conn, keys, w)
        await b.recycle(conn, w, leave=False)
    s = await snapshot(conn, keys, Q, [])
    assert s["dead"] == [b"poison"] and s["queue"] == [] and s["attempts"] == {}


async def test_leave_hands_back_without_counting_attempts(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"a"])
    await b.ensure(conn, Q, [b"p"])
    await b.claim(conn, "w1", inc, Q, 2, 1)
    with pytest.raises(FencedError):
        await b.recycle(conn, "w1", leave=True, incarnation="not-mine")
    r = await b.recycle(conn, "w1", leave=True, incarnation=inc, queues=[Q])
    assert (r.returned, r.dead_lettered) == (2, 0)
    s = await snapshot(conn, keys, Q, ["w1"])
    assert s["queue"] == [b"a", b"p"] and s["attempts"] == {}
    assert s["persistent"] == {} and s["standby"] == {b"p"}
    assert await conn.execute("EXISTS", keys.heartbeat("w1")) == 0


async def test_unserve_hands_back_one_queue(conn: Connection, b: Binding, keys: Keys) -> None:
    inc = await join(b, conn, "w1", Q, "q2")
    await b.enqueue(conn, Q, [b"a"])
    await b.enqueue(conn, "q2", [b"z"])
    await b.claim(conn, "w1", inc, Q, 1, 0)
    await b.claim(conn, "w1", inc, "q2", 1, 0)
    assert await b.unserve(conn, "w1", Q) == 1
    assert await b.unserve(conn, "w1", Q) == 0
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"a"]
    assert await conn.execute("SMEMBERS", keys.serves("w1")) == [b"q2"]
    with pytest.raises(CommandError, match="NOT_SERVING"):
        await b.claim(conn, "w1", inc, Q, 1, 0)


async def test_cancel_removes_queued_copies_and_running_processes_everywhere(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    i1 = await join(b, conn, "w1", Q)
    i2 = await join(b, conn, "w2", Q)
    await b.enqueue(conn, Q, [b"x", b"y", b"x", b"x", b"x"])
    (p1,) = (await b.claim(conn, "w1", i1, Q, 1, 0)).processes  # x
    (_, p2) = (await b.claim(conn, "w2", i2, Q, 2, 0)).processes  # y, x
    await conn.execute("ZADD", keys.delayed(Q), 10**15, b"x")
    assert await b.cancel(conn, Q, b"x") == (3, 2)  # 2 queued + 1 delayed, 2 running
    s = await snapshot(conn, keys, Q, ["w1", "w2"])
    assert s["queue"] == [] and s["delayed"] == []
    assert s["inbox"] == {"w1": {p1.id}, "w2": {p2.id}}
    assert s["held"]["w1"] == set() and len(s["held"]["w2"]) == 1  # y stays
    assert await b.finish(conn, "w1", i1, Q, [p1.id]) == [False]  # cancelled: no finish
    assert await b.cancel(conn, Q, b"x") == (0, 0)  # twice


async def test_cancel_of_a_persistent_task(conn: Connection, b: Binding, keys: Keys) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.ensure(conn, Q, [b"dev", b""])
    procs = (await b.claim(conn, "w1", inc, Q, 1, 0)).processes
    assert await b.cancel(conn, Q, b"dev") == (0, 1)
    assert await b.cancel(conn, Q, b"") == (1, 0)  # empty payload, still queued
    s = await snapshot(conn, keys, Q, ["w1"])
    assert s["persistent"] == {} and s["standby"] == set()
    assert s["queue"] == [] and s["inbox"]["w1"] == {procs[0].id}
    assert await b.ensure(conn, Q, [b"dev"]) == [True]  # can be ensured again


async def test_a_persistent_task_is_in_standby_while_queued_and_in_persistent_while_running(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    """The persistent task's payload moves standby set -> persistent hash on
    each claim and back on each way a process is handed back; never in both."""
    i1 = await join(b, conn, "w1", Q)
    i2 = await join(b, conn, "w2", Q)

    async def where() -> tuple[set[bytes], dict[bytes, bytes]]:
        s = await snapshot(conn, keys, Q, [])
        assert not s["standby"] & set(s["persistent"]), s  # never in both
        return s["standby"], s["persistent"]

    async def claim(w: str, inc: str) -> str:
        await conn.execute("ZADD", keys.delayed(Q), "XX", 0, b"dev")  # due now, if delayed
        (p,) = (await b.claim(conn, w, inc, Q, 1, 0)).processes
        assert p.persistent and p.task == b"dev"
        assert await where() == (set(), {b"dev": p.id.encode()})
        return p.id

    await b.ensure(conn, Q, [b"dev"])
    assert await where() == ({b"dev"}, {})
    pid = await claim("w1", i1)
    assert await b.give_back(conn, "w1", Q, [pid], failed=False) == [(1, 0)]
    assert await where() == ({b"dev"}, {})
    pid = await claim("w1", i1)
    [(outcome, _)] = await b.give_back(
        conn, "w1", Q, [pid], failed=True, backoff_ms=10_000, backoff_cap_ms=10_000
    )
    assert outcome == 2 and await conn.execute("ZRANGE", keys.delayed(Q), 0, -1) == [b"dev"]
    assert await where() == ({b"dev"}, {})  # delayed is standby too
    await claim("w1", i1)
    assert await b.unserve(conn, "w1", Q) == 1
    assert await where() == ({b"dev"}, {})
    await claim("w2", i2)
    await expire_worker(conn, keys, "w2")
    assert (await b.recycle(conn, "w2", leave=False)).returned == 1
    assert await where() == ({b"dev"}, {})
    await b.serve(conn, "w1", i1, Q)
    await claim("w1", i1)
    assert (await b.recycle(conn, "w1", leave=True, incarnation=i1)).returned == 1
    assert await where() == ({b"dev"}, {})
    i3 = await join(b, conn, "w3", Q)
    pid = await claim("w3", i3)
    assert await b.cancel(conn, Q, b"dev") == (0, 1)
    assert await where() == (set(), {})
    assert await b.finish(conn, "w3", i3, Q, [pid]) == [False]
    assert await where() == (set(), {})
    # cancelled while standing by (queued): in neither either
    await b.ensure(conn, Q, [b"dev"])
    assert await b.cancel(conn, Q, b"dev") == (1, 0)
    assert await where() == (set(), {})
    assert await conn.execute("EXISTS", keys.standby(Q), keys.persistent(Q)) == 0


async def test_delete_queue_removes_everything_and_cancels_running(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"a", b"b", b"c"])
    await b.ensure(conn, Q, [b"p"])
    (a,) = (await b.claim(conn, "w1", inc, Q, 1, 0)).processes
    await conn.execute("RPUSH", keys.dead(Q), "d")
    assert await b.delete_queue(conn, Q) == (3 + 1, 1)  # the dead letter counts
    s = await snapshot(conn, keys, Q, ["w1"])
    assert s == {
        "queue": [], "persistent": {}, "procs": {}, "attempts": {}, "delayed": [], "dead": [],
        "standby": set(), "held": {"w1": set()}, "inbox": {"w1": {a.id}},
    }  # fmt: skip
    assert Q.encode() not in await conn.execute("SMEMBERS", keys.queues)
    assert await b.delete_queue(conn, Q) == (0, 0)


async def test_reap_check_lists_expired_workers_and_the_next_deadline(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await join(b, conn, "w1", ttl_ms=60_000)
    await join(b, conn, "w2", ttl_ms=30_000)
    _, nxt, n, dead = await b.reap_check(conn)
    assert dead == [] and 29_000 < nxt <= 30_000 and n == 2
    await expire_worker(conn, keys, "w2")
    _, _, n, dead = await b.reap_check(conn)
    assert dead == ["w2"] and n == 2  # counted until recycled
    await b.recycle(conn, "w2", leave=False)
    assert (await b.reap_check(conn)).workers == 1


async def test_scripts_survive_script_flush(conn: Connection, b: Binding) -> None:
    await b.enqueue(conn, Q, [b"a"])
    await conn.execute("SCRIPT", "FLUSH")
    assert await b.enqueue(conn, Q, [b"b"]) == 2


async def test_finish_and_claim_runs_the_finish_first_in_one_write(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    i1 = await join(b, conn, "w1", Q)
    await join(b, conn, "w2", Q)
    await b.ensure(conn, Q, [b"d1", b"d2"])  # a fair share of 1 each
    (d1,) = (await b.claim(conn, "w1", i1, Q, 10, 0, fair=True)).processes
    await conn.execute("SCRIPT", "LOAD", b.scripts["finish_claim"].source)  # no NOSCRIPT detour
    writes = conn.statistics().writes
    f, c = await b.finish_and_claim(
        conn, "w1", i1, Q, [d1.id], b.claim_call("w1", i1, Q, 10, 0, fair=True)
    )
    assert conn.statistics().writes == writes + 1
    assert f.unwrap() == [True]
    # the claim saw d1 finished: w1 holds nothing, so d2 is within its share
    r = c.unwrap()
    assert [p.task for p in r.processes] == [b"d2"] and not r.held_back
    s = await snapshot(conn, keys, Q, ["w1"])
    (d2,) = r.processes
    assert s["held"]["w1"] == {d2.id} and s["persistent"] == {b"d2": d2.id.encode()}


async def claimed_a_of_ab(b: Binding, conn: Connection) -> tuple[str, Process]:
    """w1 serves Q, which holds a and b; w1 has claimed a. Returns (its
    incarnation, the process of a)."""
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"a", b"b"])
    (a,) = (await b.claim(conn, "w1", inc, Q, 1, 0)).processes
    return inc, a


async def test_finish_and_claim_is_one_step_an_error_leaves_everything(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc, a = await claimed_a_of_ab(b, conn)
    # a claim refused (a bad count): the finish did not run either
    f, c = await b.finish_and_claim(conn, "w1", inc, Q, [a.id], b.claim_call("w1", inc, Q, 0, 0))
    for o in (f, c):
        with pytest.raises(CommandError, match="BAD_ARG"):
            o.unwrap()
    s = await snapshot(conn, keys, Q, ["w1"])
    assert s["held"]["w1"] == {a.id} and list(s["procs"]) == [a.id.encode()]
    # a queue not served: refused before anything is written
    f, c = await b.finish_and_claim(
        conn, "w1", inc, "other", [a.id], b.claim_call("w1", inc, "other", 1, 0)
    )
    with pytest.raises(CommandError, match="NOT_SERVING"):
        f.unwrap()
    assert (await snapshot(conn, keys, Q, ["w1"]))["held"]["w1"] == {a.id}
    # a lease gone: nothing changes, both are fenced
    await expire_worker(conn, keys, "w1")
    f, c = await b.finish_and_claim(conn, "w1", inc, Q, [a.id], b.claim_call("w1", inc, Q, 1, 0))
    for o in (f, c):
        with pytest.raises(FencedError, match="no lease"):
            o.unwrap()
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"b"]
    assert list((await snapshot(conn, keys, Q, ["w1"]))["procs"]) == [a.id.encode()]


async def test_finish_and_claim_reports_each_id_and_claims_after(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc, a = await claimed_a_of_ab(b, conn)
    # a's id twice, an id never claimed, and a claim of what is left
    f, c = await b.finish_and_claim(
        conn, "w1", inc, Q, [a.id, "123", a.id], b.claim_call("w1", inc, Q, 5, 0)
    )
    assert f.unwrap() == [True, False, False]
    r = c.unwrap()
    assert [p.task for p in r.processes] == [b"b"] and r.remaining == 0
    s = await snapshot(conn, keys, Q, ["w1"])
    assert s["held"]["w1"] == {r.processes[0].id}
    # nothing to claim: the finish still goes through, the reply says so
    f, c = await b.finish_and_claim(
        conn, "w1", inc, Q, [r.processes[0].id], b.claim_call("w1", inc, Q, 5, 0)
    )
    assert f.unwrap() == [True] and c.unwrap().processes == ()
    assert (await snapshot(conn, keys, Q, ["w1"]))["held"].get("w1", set()) == set()


async def test_finish_and_claim_tells_persistent_and_retried_processes(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"a", b"x"])
    a, x = (await b.claim(conn, "w1", inc, Q, 2, 0)).processes
    # x fails once and is due again at once; d1 is a persistent task
    await b.give_back(conn, "w1", Q, [x.id], failed=True, backoff_ms=0, backoff_cap_ms=0)
    await b.ensure(conn, Q, [b"d1"])
    f, c = await b.finish_and_claim(conn, "w1", inc, Q, [a.id], b.claim_call("w1", inc, Q, 5, 0))
    assert f.unwrap() == [True]
    got = {p.task: p for p in c.unwrap().processes}
    assert set(got) == {b"x", b"d1"}
    assert got[b"x"].attempts == 1 and not got[b"x"].persistent
    assert got[b"d1"].persistent and got[b"d1"].attempts == 0
    s = await snapshot(conn, keys, Q, ["w1"])
    # the ids told by the compact reply are the processes Redis holds
    assert s["held"]["w1"] == {p.id for p in got.values()}
    for p in got.values():
        assert p.token == int(p.id) and p.worker_id == "w1" and p.queue == Q
    assert s["persistent"] == {b"d1": got[b"d1"].id.encode()}


async def test_finish_and_claim_with_results_is_two_calls_each_on_its_own(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc, a = await claimed_a_of_ab(b, conn)
    keep = ResultsToKeep(60_000, {a.id: (a.task, b"v")})
    # the finish (keeping a's result) goes through, the claim is refused
    f, c = await b.finish_and_claim(
        conn, "w1", inc, Q, [a.id], b.claim_call("w1", inc, Q, 0, 0), keep
    )
    assert f.unwrap() == [True]
    with pytest.raises(CommandError, match="BAD_ARG"):
        c.unwrap()


async def test_finish_and_claim_survives_script_flush(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc, a = await claimed_a_of_ab(b, conn)
    await conn.execute("SCRIPT", "FLUSH")
    f, c = await b.finish_and_claim(conn, "w1", inc, Q, [a.id], b.claim_call("w1", inc, Q, 1, 0))
    assert f.unwrap() == [True]
    (p,) = c.unwrap().processes
    assert p.task == b"b"
    s = await snapshot(conn, keys, Q, ["w1"])
    assert list(s["procs"]) == [p.id.encode()]


def test_includes_are_spliced_as_plain_text_once_per_script(tmp_path: Path) -> None:
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "b.lua").write_text("-- b\nlocal function b() end\n")
    (tmp_path / "include" / "a.lua").write_text(
        "-- a\n--!include include/b.lua\nlocal function a() b() end\n"
    )
    (tmp_path / "s.lua").write_text(
        "-- s.lua\n--!include include/a.lua\n--!include include/b.lua\nreturn a()\n"
    )
    out = expand_script(tmp_path, "s.lua").decode()
    # depth first, each file once (b comes with a, its second line is dropped)
    assert (
        out
        == "-- s.lua\n-- a\n-- b\nlocal function b() end\nlocal function a() b() end\nreturn a()\n"
    )


def test_an_include_cycle_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "a.lua").write_text("--!include include/b.lua\n")
    (tmp_path / "include" / "b.lua").write_text("--!include include/a.lua\n")
    (tmp_path / "s.lua").write_text("--!include include/a.lua\nreturn 1\n")
    with pytest.raises(
        ProtocolError, match=re.escape("include cycle s.lua -> include/a.lua -> include/b.lua")
    ):
        expand_script(tmp_path, "s.lua")


def test_every_include_names_what_it_provides_and_needs() -> None:
    proto = Path(__file__).resolve().parent.parent / "protocol"
    files = sorted((proto / "include").glob("*.lua"))
    assert files
    for f in files:
        text = f.read_text()
        head = text.split("\n\n")[0]
        assert head.startswith(f"-- include/{f.name}: "), f.name
        assert "needs" in head, f.name
        for fn in re.findall(r"^local function (\w+)\(", text, re.M):
            assert fn in head, (f.name, fn)  # every helper is named in the header
        # an include is given its keys and arguments (protocol/README.md): its
        # code (comments aside) never reads the script's KEYS or ARGV
        code = re.sub(r"--[^\n]*", "", text)
        assert not re.search(r"\b(KEYS|ARGV)\b", code), f.name
    for name, script in load_scripts().items():
        assert b"--!include" not in script.source, name


def test_every_script_states_its_contract_in_a_header() -> None:
    proto = Path(__file__).resolve().parent.parent / "protocol"
    for name in load_scripts():
        head = (proto / f"{name}.lua").read_text().split("--!include")[0].split("\nlocal ")[0]
        assert head.startswith(f"-- {name}.lua: "), name
        for part in ("KEYS[1]", "ARGV[1]", "Returns:", "Errors:", "Publishes:"):
            assert part in head, (name, part)


async def test_fair_claim_takes_a_fair_share_of_persistent_tasks(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    i1 = await join(b, conn, "w1", Q)
    i2 = await join(b, conn, "w2", Q)
    assert sorted(await conn.execute("SMEMBERS", keys.servers(Q))) == [b"w1", b"w2"]
    await b.ensure(conn, Q, [b"d1", b"d2", b"d3"])
    await b.enqueue(conn, "other", [b"x"])  # other queues do not count
    r1 = await b.claim(conn, "w1", i1, Q, 10, 0, fair=True)
    assert [p.task for p in r1.processes] == [b"d1", b"d2"] and r1.held_back  # ceil(3/2) = 2
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"d3"]  # left at the head
    r1 = await b.claim(conn, "w1", i1, Q, 10, 0, fair=True)
    assert r1.processes == () and r1.held_back
    # queued and running persistent tasks both count: ceil((2 + 2) / 2) = 2
    await b.ensure(conn, Q, [b"d4"])
    r2 = await b.claim(conn, "w2", i2, Q, 10, 0, fair=True)
    assert [p.task for p in r2.processes] == [b"d3", b"d4"] and not r2.held_back
    # one-shot tasks are never held back; an unfair claim takes anything
    await b.enqueue(conn, Q, [b"job"])
    r1 = await b.claim(conn, "w1", i1, Q, 10, 0, fair=True)
    assert [p.task for p in r1.processes] == [b"job"]
    # the servers set follows unserve and recycle
    await b.unserve(conn, "w2", Q)
    assert await conn.execute("SMEMBERS", keys.servers(Q)) == [b"w1"]
    await expire_worker(conn, keys, "w1")
    await b.recycle(conn, "w1", leave=False)
    assert await conn.execute("EXISTS", keys.servers(Q)) == 0
    with pytest.raises(CommandError, match="BAD_ARG"):
        await conn.execute(
            "EVALSHA", b.scripts["claim"].sha, 11, *(["k"] * 11), "w", "i", Q, 1, 0, 2
        )


async def test_a_repeated_crash_backs_off_with_the_claimers_backoff(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await b.ensure(conn, Q, [b"dev"])
    where = []
    for n in range(3):
        w = f"w{n}"
        inc = await join(b, conn, w, Q)
        await conn.execute("ZADD", keys.delayed(Q), "XX", 0, b"dev")  # due now, if delayed
        await b.claim(conn, w, inc, Q, 1, 0, backoff_ms=500, backoff_cap_ms=800)
        await expire_worker(conn, keys, w)
        await b.recycle(conn, w, leave=False)
        s = await snapshot(conn, keys, Q, [])
        score = await conn.execute("ZSCORE", keys.delayed(Q), b"dev")
        where.append((s["queue"], s["delayed"], score is not None))
        assert s["persistent"] == {} and s["standby"] == {b"dev"}  # never dead-lettered
    assert where[0] == ([b"dev"], [], False)  # first crash: failover at once
    assert where[1] == ([], [b"dev"], True)  # then the claimer's backoff
    sec, usec = await conn.execute("TIME")
    now = int(sec) * 1000 + int(usec) // 1000
    due = int(float(await conn.execute("ZSCORE", keys.delayed(Q), b"dev")))
    assert 0 < due - now <= 800  # base 500 doubled, capped at 800


async def test_tokens_keep_increasing_when_redis_loses_the_counter(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc, a = await claimed_a_of_ab(b, conn)
    await conn.execute("DEL", keys.token)  # as after a restart without persistence
    (bb,) = (await b.claim(conn, "w1", inc, Q, 1, 0)).processes
    assert bb.token > a.token
    now_us = int((await conn.execute("TIME"))[0]) * 10**6
    assert abs(bb.token - now_us) < 5 * 10**6  # floored at the Redis clock


async def test_a_reap_lease_gives_each_dead_worker_to_one_caller(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    for w in ("w1", "w2", "w3"):
        await join(b, conn, w, Q)
    await expire_worker(conn, keys, "w1")
    await expire_worker(conn, keys, "w2")
    now, _, _, first = await b.reap_check(conn, 1, 5000)
    _, _, _, second = await b.reap_check(conn, 1, 5000)
    _, _, _, third = await b.reap_check(conn, 1, 5000)
    assert sorted(first + second) == ["w1", "w2"] and third == []
    # a caller that took a lease and died: the worker comes back once it ends
    await conn.execute("ZADD", keys.workers, "XX", 0, "w1")
    _, _, _, taken = await b.reap_check(conn, 1, 100)
    assert taken == ["w1"] and (await b.reap_check(conn, 1, 100)).dead == []

    async def back() -> bool:  # taken again (for 5 s) once the 100 ms lease ended
        return (await b.reap_check(conn, 1, 5000)).dead == ["w1"]

    await wait_until(back, within=2, what="w1 back once the lease ended")
    await conn.execute("ZADD", keys.workers, "XX", now + 5000, "w1")
    leased = int(float(await conn.execute("ZSCORE", keys.workers, first[0])))
    assert 5000 <= leased - now < 5100
    # a listed worker that is alive after all gets its true deadline back
    await conn.execute("ZADD", keys.workers, 0, "w3")
    _, _, _, (w,) = await b.reap_check(conn, 1, 60_000)
    assert w == "w3" and (await b.recycle(conn, "w3", leave=False)).alive
    pttl = await conn.execute("PTTL", keys.heartbeat("w3"))
    sec, usec = await conn.execute("TIME")
    deadline = int(float(await conn.execute("ZSCORE", keys.workers, "w3")))
    assert abs(deadline - (int(sec) * 1000 + int(usec) // 1000 + pttl)) < 50


async def test_a_persistent_task_that_ran_a_lease_before_each_crash_fails_over_at_once(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await b.ensure(conn, Q, [b"dev"])
    for n in range(3):
        w = f"w{n}"
        inc = await join(b, conn, w, Q)
        (p,) = (await b.claim(conn, w, inc, Q, 1, 0, backoff_ms=500, ttl_ms=20)).processes
        assert p.task == b"dev"
        # The process must run for more than its worker's lease ttl (20 ms)
        # before the recycle: 60 ms on the clock the scripts read.
        claimed = await redis_ms(conn)

        async def ran_60_ms(claimed: int = claimed) -> bool:
            return await redis_ms(conn) >= claimed + 60

        await wait_until(ran_60_ms, what="60 ms on the Redis clock")
        await expire_worker(conn, keys, w)
        await b.recycle(conn, w, leave=False)
        s = await snapshot(conn, keys, Q, [])
        assert (s["queue"], s["delayed"]) == ([b"dev"], [])  # back at once, every time
        assert s["attempts"] == {b"dev": b"1"}  # the count starts over


async def test_a_queued_persistent_task_is_kept_where_it_costs_least(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    """While the persistent hash is compact (at most 128 fields of at most 64
    bytes), a queued task is a field with the value ""; otherwise a member of
    the standby set. Never both; either way it is claimed as persistent."""

    async def raw() -> tuple[set[bytes], dict[bytes, bytes], bytes]:
        in_set, pers, enc = await conn.pipeline(
            [
                ("SMEMBERS", keys.standby(Q)),
                ("HGETALL", keys.persistent(Q)),
                ("OBJECT", "ENCODING", keys.persistent(Q)),
            ]
        )
        marks = {pers[i]: pers[i + 1] for i in range(0, len(pers), 2)}
        assert not set(in_set) & set(marks)
        return set(in_set), marks, enc or b""

    long = b"x" * 65
    await b.ensure(conn, Q, [b"p0", long])
    in_set, marks, enc = await raw()
    assert (in_set, marks) == ({long}, {b"p0": b""}) and enc != b"hashtable"
    await b.ensure(conn, Q, [b"p%d" % i for i in range(1, 200)])
    in_set, marks, enc = await raw()
    assert len(marks) == 128 and set(marks.values()) == {b""} and enc != b"hashtable"
    assert len(in_set) == 200 - 128 + 1  # the rest, and the long one
    # claim everything: each leaves the set or its "" for its process id
    inc = await join(b, conn, "w1", Q)
    got = (await b.claim(conn, "w1", inc, Q, 1000, 0)).processes
    assert len(got) == 201 and all(p.persistent for p in got)
    in_set, marks, enc = await raw()
    assert in_set == set() and len(marks) == 201 and b"" not in marks.values()
    assert enc == b"hashtable"
    # the hash is a hash table now: handed back, they go to the set
    await b.give_back(conn, "w1", Q, [p.id for p in got[:150]], failed=False)
    in_set, marks, _ = await raw()
    assert in_set == {p.task for p in got[:150]} and len(marks) == 51
    assert {p.task for p in (await b.claim(conn, "w1", inc, Q, 1000, 0)).processes} == in_set


async def test_finish_counts_an_id_given_twice_once(
    conn: Connection, b: Binding, keys: Keys, redis_url: str
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"a", b"b"])
    a, c = (await b.claim(conn, "w1", inc, Q, 2, 0)).processes
    async with open_pubsub(redis_url) as pubsub:
        await pubsub.subscribe(keys.done_channel(Q), sharded=True)
        await conn.execute("SET", keys.awaiting(Q), b"", "PX", 60_000)  # someone awaits
        assert await b.finish(conn, "w1", inc, Q, [a.id, a.id, "nope", c.id]) == [
            True,
            False,
            False,
            True,
        ]
        got = await messages_until_end(conn, pubsub, keys.done_channel(Q))
    assert got == [b"a", b"b", b"end"]  # one done message per task
    s = await snapshot(conn, keys, Q, ["w1"])
    assert s["procs"] == {} and s["held"]["w1"] == set()


async def test_finish_publishes_done_messages_only_while_someone_awaits(
    conn: Connection, b: Binding, keys: Keys, redis_url: str
) -> None:
    """The done message of a finished task is published only while the
    queue's awaiting key exists (client.result keeps it); finish.lua and
    finish_results.lua alike. A caller that does not pass the optional
    awaiting key (an older peer) publishes every time, as before."""
    from mesh._replies import ResultsToKeep

    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"a", b"b", b"c", b"d", b"e"])
    a, bb, c, d, e = (await b.claim(conn, "w1", inc, Q, 5, 0)).processes
    done = keys.done_channel(Q)
    async with open_pubsub(redis_url) as pubsub:
        await pubsub.subscribe(done, sharded=True)
        # nobody awaits: nothing published, by either script
        assert await b.finish(conn, "w1", inc, Q, [a.id]) == [True]
        keep = ResultsToKeep(60_000, {bb.id: (b"b", b"1")})
        assert await b.finish(conn, "w1", inc, Q, [bb.id], keep) == [True]
        assert await messages_until_end(conn, pubsub, done) == [b"end"]
        # a waiter marks the queue: both publish
        await conn.execute("SET", keys.awaiting(Q), b"", "PX", 60_000)
        assert await b.finish(conn, "w1", inc, Q, [c.id]) == [True]
        keep = ResultsToKeep(60_000, {d.id: (b"d", b"1")})
        assert await b.finish(conn, "w1", inc, Q, [d.id], keep) == [True]
        assert await messages_until_end(conn, pubsub, done) == [b"c", b"d", b"end"]
        # an older caller without the optional key: published, waiter or not
        await conn.execute("DEL", keys.awaiting(Q))
        call = b.finish_call("w1", inc, Q, [e.id])
        old = attrs.evolve(call, keys=call.keys[:6], evalsha=None)
        assert await b.run(conn, old) == [True]
        assert await messages_until_end(conn, pubsub, done) == [b"e", b"end"]


async def test_a_crash_counts_once_for_each_process_of_a_payload(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    """A worker may hold two processes of one one-shot payload (enqueued
    twice); its crash is a failed attempt of each, counted in claim order."""
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"dup", b"dup", b"once"])
    assert len((await b.claim(conn, "w1", inc, Q, 3, 0)).processes) == 3
    await expire_worker(conn, keys, "w1")
    await b.recycle(conn, "w1", leave=False)
    s = await snapshot(conn, keys, Q, [])
    assert s["attempts"] == {b"dup": b"2", b"once": b"1"}
    # the second crash of each copy waits for its backoff; at a limit of 3 the
    # third (counted on the oldest claim, which went back to the head) is dead
    assert s["queue"] == [b"dup", b"once"] and len(s["delayed"]) == 1
    inc2 = await join(b, conn, "w2", Q)
    got = (await b.claim(conn, "w2", inc2, Q, 1, 3)).processes
    assert [(p.task, p.attempts) for p in got] == [(b"dup", 2)]
    await expire_worker(conn, keys, "w2")
    r = await b.recycle(conn, "w2", leave=False)
    assert (r.returned, r.dead_lettered) == (0, 1)
    assert (await snapshot(conn, keys, Q, []))["dead"] == [b"dup"]


async def test_rebalance_moves_the_surplus_to_its_receiver_only_and_loses_nothing(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    """rebalance.lua marks the minimum (a receiver's deficit, from the
    largest surplus, counting what is on its way), the holder learns it from
    its heartbeat, its hand-back is reserved for the receiver (no third
    worker takes it), and a reservation whose receiver died goes back to
    the queue: nothing is lost mid-handoff."""
    i1 = await join(b, conn, "w1", Q)
    await b.ensure(conn, Q, [b"d%d" % i for i in range(6)])
    c = await b.claim(conn, "w1", i1, Q, 10, 0, fair=True)
    assert len(c.processes) == 6  # alone: all of them
    i2 = await join(b, conn, "w2", Q)
    i3 = await join(b, conn, "w3", Q)
    # P = 6, S = 3: each should hold 2; w1 holds 4 too many
    r2, servers = await b.rebalance(conn, "w2", i2, Q, 10, 60_000)
    assert (r2.marked, r2.persistent, r2.servers, r2.held) == (2, 6, 3, 0)
    assert sorted(servers) == ["w1", "w2", "w3"]
    r3, _ = await b.rebalance(conn, "w3", i3, Q, 1, 60_000, servers)
    assert r3.marked == 1  # its limit per request
    r3, _ = await b.rebalance(conn, "w3", i3, Q, 10, 60_000, servers)
    assert r3.marked == 1  # what is on its way to it counts: 1 more, not 2
    r2, _ = await b.rebalance(conn, "w2", i2, Q, 10, 60_000, servers)
    assert (r2.marked, r2.held) == (0, 2)  # nothing more: within its share
    moving = {
        k.decode(): v.decode().split(":")[0]
        for k, v in _pairs(await conn.execute("HGETALL", keys.moving(Q))).items()
    }
    assert sorted(moving.values()) == ["w2", "w2", "w3", "w3"]
    hb = await b.heartbeat(conn, "w1", i1, 60_000, [], [Q])
    assert sorted(hb.release[0]) == sorted(moving)
    # visible: each worker's load against its share, and what is moving
    shares = {w.id: w.shares for w in await mesh.Client(conn, keys, min_replicas=0).workers()}
    share = functools.partial(mesh.QueueShare, Q, fair_min=2, fair_max=2, share=2.0)
    assert shares["w1"] == (share(held=6, incoming=0, outgoing=4, weight=6),)
    assert shares["w2"] == (share(held=0, incoming=2, outgoing=0, weight=0),)
    assert shares["w3"] == (share(held=0, incoming=2, outgoing=0, weight=0),)
    assert (hb.persistent, hb.servers) == ((6,), (3,))
    # w1's handlers exited: it hands the four back; each is reserved for its
    # receiver, not queued for anyone
    to_w2 = [pid for pid, w in moving.items() if w == "w2"]
    to_w3 = [pid for pid, w in moving.items() if w == "w3"]
    await b.give_back(conn, "w1", Q, to_w2 + to_w3, failed=False)
    assert await conn.execute("LLEN", keys.queue(Q)) == 0
    assert await conn.execute("HLEN", keys.reserved(Q)) == 4
    assert await conn.execute("HLEN", keys.moving(Q)) == 0
    # a third worker gets none of them; w2 takes its own, past the fair share check
    i4 = await join(b, conn, "w4", Q)
    assert (await b.claim(conn, "w4", i4, Q, 10, 0, fair=True)).processes == ()
    got = await b.claim(conn, "w2", i2, Q, 10, 0, fair=True)
    assert len(got.processes) == 2 and all(p.persistent for p in got.processes)
    # w3 dies before it claims: its reservations run out (forced here) and
    # go back to the head of the queue for anyone
    await conn.execute("DEL", keys.heartbeat("w3"))
    for payload in await conn.execute("HKEYS", keys.reserved(Q)):
        await conn.execute("HSET", keys.reserved(Q), payload, "w3:1")
    got4 = await b.claim(conn, "w4", i4, Q, 10, 0)
    assert len(got4.processes) == 2
    procs = await conn.execute("HLEN", keys.procs(Q))
    assert procs == 6 and await conn.execute("HLEN", keys.reserved(Q)) == 0


async def test_rebalance_names_the_servers_it_was_not_given(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    i1 = await join(b, conn, "w1", Q)
    await join(b, conn, "w2", Q)
    # the binding calls again with the servers the script named
    r, servers = await b.rebalance(conn, "w1", i1, Q, 5, 1000, ["w1"])
    assert sorted(servers) == ["w1", "w2"] and r.marked == 0
    with pytest.raises(FencedError):
        await b.rebalance(conn, "w1", "wrong", Q, 5, 1000, servers)


def _pairs(reply: list[bytes] | dict[bytes, bytes]) -> dict[bytes, bytes]:
    if isinstance(reply, dict):
        return reply
    return {reply[i]: reply[i + 1] for i in range(0, len(reply), 2)}


async def test_a_claim_of_persistent_and_one_shot_tasks_after_a_crash(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    """claim.lua reads which popped payloads are persistent, and their
    failed attempts, for the whole claim at once, and writes the persistent
    ones' entries at once: each process still gets its own kind and count,
    and every persistent task taken leaves the standby set and the unowned
    set for its process id."""
    # enough persistent tasks that the hash is a hash table and they wait
    # in the standby set, with a few that wait in the hash ("" entries
    # before it grew), and one-shot tasks in between
    await b.ensure(conn, Q, [b"early%d" % i for i in range(3)])
    await b.enqueue(conn, Q, [b"one-a"])
    await b.ensure(conn, Q, [b"p%d" % i for i in range(300)])
    await b.enqueue(conn, Q, [b"one-b"])
    inc = await join(b, conn, "w1", Q)
    first = (await b.claim(conn, "w1", inc, Q, 1000, 0)).processes
    kinds = {p.task: p.persistent for p in first}
    assert kinds == {
        **{b"early%d" % i: True for i in range(3)},
        **{b"p%d" % i: True for i in range(300)},
        b"one-a": False,
        b"one-b": False,
    }
    assert all(p.attempts == 0 for p in first)
    # w1 crashes: every task back, its crash counted as a failed attempt
    await expire_worker(conn, keys, "w1")
    assert (await b.recycle_dead(conn, ["w1"], queues=[Q])).returned == 305
    assert await conn.execute("ZCARD", keys.unowned(Q)) == 303
    inc2 = await join(b, conn, "w2", Q)
    again = (await b.claim(conn, "w2", inc2, Q, 1000, 0)).processes
    assert {p.task: p.persistent for p in again} == kinds
    assert {p.attempts for p in again} == {1}
    pers, standby, unowned = await conn.pipeline(
        [
            ("HGETALL", keys.persistent(Q)),
            ("SCARD", keys.standby(Q)),
            ("ZCARD", keys.unowned(Q)),
        ]
    )
    owner = {pers[i]: pers[i + 1].decode() for i in range(0, len(pers), 2)}
    assert owner == {p.task: p.id for p in again if p.persistent}
    assert (standby, unowned) == (0, 0)


def test_claim_call_is_built_and_packed_once_per_argument_set(keys: Keys) -> None:
    b = Binding(keys)
    call = b.claim_call("w1", "i1", Q, 10, 3, fair=True, ttl_ms=5000)
    assert b.claim_call("w1", "i1", Q, 10, 3, fair=True, ttl_ms=5000) is call
    other = b.claim_call("w1", "i1", Q, 9, 3, fair=True, ttl_ms=5000)
    assert other is not call and other.args[3] == 9
    assert b.claim_call("w1", "i1", Q, 10, 3, fair=False, ttl_ms=5000).args[5] == 0
    assert b.claim_call("w1", "i2", Q, 10, 3, fair=True, ttl_ms=5000).args[1] == "i2"
    rated = b.claim_call("w1", "i1", Q, 10, 3, fair=True, ttl_ms=5000, rate=(5, 1000))
    assert rated.keys[-2:] == (keys.rate(Q), keys.paused(Q))
    assert list(rated.args[-2:]) == [5, 1000]
    cmd = call.command()
    plain = ("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
    assert type(cmd) is Packed and cmd == plain
    assert pack(cmd) == [b"".join(pack(plain))]
    assert call.command(source=True)[:2] == ("EVAL", call.script.source)
    assert len(call.keys) == 19 and call.keys[0] == keys.heartbeat("w1")
    # no rate limit: the bucket's arguments are empty; the pause flag is last
    assert call.keys[-2:] == (keys.rate(Q), keys.paused(Q))
    assert list(call.args) == [
        "w1", "i1", Q, 10, 3, 1, 1000, 60_000, 5000, 1, keys.wake_prefix, "", "",
    ]  # fmt: skip


def test_finish_call_names_its_keys_and_ids(keys: Keys) -> None:
    b = Binding(keys)
    for ids in (["1", "2"], ["3"], []):
        call = b.finish_call("w1", "i1", Q, ids)
        assert list(call.keys) == [
            keys.heartbeat("w1"),
            keys.procs(Q),
            keys.held("w1", Q),
            keys.persistent(Q),
            keys.attempts(Q),
            keys.share(Q),
            keys.awaiting(Q),
        ]
        assert list(call.args) == ["w1", "i1", keys.done_channel(Q), *ids]
    assert b.finish_call("w2", "i9", Q, ["4"]).args[:2] == ("w2", "i9")


def test_parse_claim_builds_what_process_init_builds() -> None:
    # parse_claim sets Process's slots itself: it must cover every field
    assert _PROCESS_SLOTS == tuple(f.name for f in attrs.fields(Process))
    raw: list[int | bytes] = [1_700_000_000_123, -1, 250]
    raw += [b"1700000000123001", 0, 2, b"a\x00b"]
    raw += [b"1700000000123002", 1, 0, b""]
    r = parse_claim(raw, Q, "w1")
    assert (r.now_ms, r.remaining, r.held_back, r.next_due_ms) == (1_700_000_000_123, 0, True, 250)
    expected = (
        Process("1700000000123001", Q, b"a\x00b", 1700000000123001, "w1", False, 2, 1700000000.123),
        Process("1700000000123002", Q, b"", 1700000000123002, "w1", True, 0, 1700000000.123),
    )
    assert r.processes == expected
    assert [repr(p) for p in r.processes] == [repr(p) for p in expected]
    assert {hash(p) for p in r.processes} == {hash(p) for p in expected}
    assert attrs.evolve(r.processes[0], attempts=3).attempts == 3
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        r.processes[0].task = b"x"  # type: ignore[misc]
    assert parse_claim([5, 4, -1], Q, "w1").processes == ()
    with pytest.raises(ValueError):
        parse_claim([5, 4, -1, b"1", 0, 0], Q, "w1")  # a truncated process


async def test_a_draining_worker_leaves_the_share_and_keeps_its_processes(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    """drain.lua: the first step of a graceful stop. The worker that drains
    is no longer counted by its peers' fair share (they take what it hands
    back at once, none held back), claims nothing more, and still holds its
    processes until it hands them back, its held weight with them."""
    i1 = await join(b, conn, "w1", Q)
    i2 = await join(b, conn, "w2", Q)
    await b.serve(conn, "w1", i1, Q, 3)  # capacity 3: C = 4
    await b.ensure(conn, Q, [b"d1", b"d2", b"d3"])
    await b.ensure(conn, Q, [b"heavy"], weight=5)  # T = 8
    held = await b.claim(conn, "w1", i1, Q, 10, 0)
    assert len(held.processes) == 4
    share = keys.share(Q)
    assert await conn.execute("HMGET", share, ":capacity", "c" + "w1", "h" + "w1") == [
        b"4",
        b"3",
        b"4",
    ]
    assert await b.drain(conn, "w1", i1, Q) is True
    assert await b.drain(conn, "w1", i1, Q) is False  # once is enough
    assert await conn.execute("SMEMBERS", keys.servers(Q)) == [b"w2"]
    assert await conn.execute("SISMEMBER", keys.idle(Q), "w1") == 0
    # its capacity left the sum, its held weight stays while it holds them
    assert await conn.execute("HMGET", share, ":capacity", "c" + "w1", "h" + "w1") == [
        b"1",
        None,
        b"4",
    ]
    assert await conn.execute("SCARD", keys.held("w1", Q)) == 4
    with pytest.raises(CommandError, match="NOT_SERVING"):
        await b.claim(conn, "w1", i1, Q, 1, 0)
    # handed back one by one, as their handlers exit; w2's fair claim takes
    # each at once: its share is all of them now (8 * 1 / 1)
    by_task = {p.task: p.id for p in held.processes}
    for task in (b"heavy", b"d1", b"d2", b"d3"):
        assert await b.give_back(conn, "w1", Q, [by_task[task]], failed=False) == [(1, 0)]
        r2 = await b.claim(conn, "w2", i2, Q, 10, 0, fair=True)
        assert [p.task for p in r2.processes] == [task] and not r2.held_back
    assert await conn.execute("HMGET", share, ":capacity", "h" + "w1", "h" + "w2") == [
        b"1",
        None,
        b"4",
    ]
    # unserve ends the stop without taking the capacity out twice
    assert await b.unserve(conn, "w1", Q) == 0
    assert await conn.execute("HGET", share, ":capacity") == b"1"  # w2's alone
    assert await conn.execute("SMEMBERS", keys.servers(Q)) == [b"w2"]
    await b.serve(conn, "w1", i1, Q)  # serving again counts it again
    assert await conn.execute("HGET", share, ":capacity") == b"2"
    await expire_worker(conn, keys, "w2")
    with pytest.raises(FencedError):
        await b.drain(conn, "w2", i2, Q)


async def test_a_fair_claim_with_patience_takes_only_tasks_that_waited_that_long(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    """With a patience, a worker at its fair share takes a persistent task
    beyond it only once the task has had no owner that long (by the Redis
    clock, from {ns}:unowned): one just handed back goes to the peers below
    their share first."""
    i1 = await join(b, conn, "w1", Q)
    await join(b, conn, "w2", Q)
    await b.ensure(conn, Q, [b"d1", b"d2", b"d3", b"d4"])
    r = await b.claim(conn, "w1", i1, Q, 10, 0, fair=True, patience_ms=60_000)
    assert [p.task for p in r.processes] == [b"d1", b"d2"] and r.held_back
    # d3 and d4 have had no owner for a moment only: still held back
    r = await b.claim(conn, "w1", i1, Q, 10, 0, fair=True, patience_ms=60_000)
    assert r.processes == () and r.held_back
    # d4 has waited a minute (as if no peer took it): taken; d3 is left
    now_ms = int((await conn.execute("TIME"))[0]) * 1000
    await conn.execute("ZADD", keys.unowned(Q), now_ms - 61_000, b"d4")
    r = await b.claim(conn, "w1", i1, Q, 10, 0, fair=True, patience_ms=60_000)
    assert [p.task for p in r.processes] == [b"d4"] and r.held_back
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"d3"]
    assert await conn.execute("ZRANGE", keys.unowned(Q), 0, -1) == [b"d3"]
    for bad in (0.5, -3):
        with pytest.raises(CommandError, match="BAD_ARG fair share flag"):
            await b.claim(conn, "w1", i1, Q, 1, 0, fair=True, patience_ms=bad)  # type: ignore[arg-type]
