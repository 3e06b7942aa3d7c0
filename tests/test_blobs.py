"""Big payloads stored out of line (protocol 10, mesh/_blob.py): a payload of
more than 1 MiB is uploaded once to ``{ns}:blob:<sha1>`` and queued as its
stand-in; the scripts count its references and drop the blob with its last
copy; the worker hands the handler the exact bytes."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import anyio
import pytest

import mesh
from mesh import ConflictError, Process, _browse
from mesh._binding import Binding
from mesh._blob import BLOB_MARK, BLOB_MIN, parse_standin, payload_size, standin
from mesh._connection import Connection
from mesh._keys import Keys
from mesh._replies import ClaimReply
from mesh._view import show_payload
from mesh.testing import wait_until

from .helpers import client_and_workers
from .protocol_helpers import expire_worker, join

pytestmark = pytest.mark.both_loops

Q = "blobs"
MIB = 1 << 20


def big(tag: bytes, size: int = 3 * MIB) -> bytes:
    """``size`` bytes that start with ``tag`` and differ between tags."""
    return (tag + os.urandom(64)) * (size // (len(tag) + 64)) + tag[: size % (len(tag) + 64)]


def blob_key(keys: Keys, payload: bytes) -> str:
    return keys.blob(hashlib.sha1(payload).hexdigest())


async def refs(conn: Connection, keys: Keys, payload: bytes) -> int | None:
    """The blob's reference count, None when the key is gone."""
    if not await conn.execute("EXISTS", blob_key(keys, payload)):
        return None
    return int(await conn.execute("HGET", blob_key(keys, payload), "n") or 0)


async def uploaded(conn: Connection, b: Binding, tag: bytes) -> tuple[bytes, bytes]:
    """A big payload (``tag``) uploaded: (payload, its stand-in)."""
    p = big(tag)
    await b.put_blobs(conn, [p])
    return p, standin(p)


# --- the stand-in ----------------------------------------------------------------


def test_a_standin_is_a_pure_function_of_the_payload() -> None:
    p = big(b"x")
    s = standin(p)
    assert s == standin(bytes(p)) and s.startswith(BLOB_MARK) and len(s) < 400
    info = parse_standin(s)
    assert info is not None
    assert (info.sha, info.size, info.head) == (hashlib.sha1(p).hexdigest(), len(p), p[:256])
    small = b"s" * BLOB_MIN
    assert standin(small) is small  # up to 1 MiB a payload is queued as it is
    # shown to humans (mesh status, the dashboard) as the payload's first bytes
    text = b"report:" + b"r" * (2 * MIB)
    assert show_payload(standin(text), 20) == "report:rrrrrrrrrrrr…"
    assert payload_size(standin(text)) == len(text) and payload_size(b"abc") == 3


async def test_a_payload_starting_with_the_mark_is_refused_in_one_line(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        with pytest.raises(ValueError, match="mesh-blob") as info:
            await client.enqueue(Q, BLOB_MARK + b"x")
        assert "\n" not in str(info.value)
        with pytest.raises(ValueError, match="mesh-blob"):
            await client.ensure(Q, BLOB_MARK)
        assert await client.tasks(Q) == []


async def test_a_schedule_refuses_a_payload_over_one_mib(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        with pytest.raises(ValueError, match="at most 1048576 bytes") as info:
            await client.schedule(Q, big(b"s"), every=60)
        assert "\n" not in str(info.value)
        assert await client.schedules(Q) == []


# --- the scripts ------------------------------------------------------------------


async def test_put_blob_expires_until_an_enqueue_references_it(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    p = big(b"upload")
    await b.put_blobs(conn, [p])
    key = blob_key(keys, p)
    assert await conn.execute("HGET", key, "d") == p
    assert 3_500_000 < int(await conn.execute("PTTL", key)) <= 3_600_000
    await b.enqueue(conn, Q, [standin(p)])
    assert int(await conn.execute("PTTL", key)) == -1  # referenced: kept
    assert await refs(conn, keys, p) == 1
    # uploading again while referenced sets no expiry
    await b.put_blobs(conn, [p])
    assert int(await conn.execute("PTTL", key)) == -1


async def test_an_enqueue_whose_upload_expired_is_refused_and_writes_nothing(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    p = big(b"gone")
    await b.put_blobs(conn, [p])
    await conn.execute("DEL", blob_key(keys, p))  # the hour passed (forced, not slept)
    for call in (
        b.enqueue(conn, Q, [b"small", standin(p)]),
        b.ensure(conn, Q, [standin(p)], 1),
        b.delay(conn, Q, [standin(p)], in_ms=1000),
        b.enqueue_group(conn, Q, "g", [standin(p)]),
    ):
        with pytest.raises(ConflictError, match=r"task [01] of this call is a big payload whose"):
            await call
    assert await conn.execute("LLEN", keys.queue(Q)) == 0
    assert await conn.execute("EXISTS", keys.persistent(Q), keys.delayed(Q)) == 0


async def test_a_claimed_copy_counts_until_finished(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    p, s = await uploaded(conn, b, b"twice")
    await b.enqueue(conn, Q, [s, s])
    assert await refs(conn, keys, p) == 2
    inc = await join(b, conn, "w1", Q)
    c = await b.claim(conn, "w1", inc, Q, 2, 0)
    assert [q.task for q in c.processes] == [s, s]
    assert await refs(conn, keys, p) == 2  # a claim moves copies, it adds none
    await b.finish(conn, "w1", inc, Q, [c.processes[0].id])
    assert await refs(conn, keys, p) == 1
    await b.finish(conn, "w1", inc, Q, [c.processes[1].id])
    assert await refs(conn, keys, p) is None


async def test_delaying_one_big_payload_twice_keeps_one_reference(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    p = big(b"later")
    await b.put_blobs(conn, [p])
    first = await b.delay(conn, Q, [standin(p), standin(p)], in_ms=60_000)
    again = await b.delay(conn, Q, [standin(p)], in_ms=1_000)
    assert (first.added, again.added) == (1, 0)
    assert await refs(conn, keys, p) == 1
    assert await mesh_cancel(conn, b, standin(p)) == 1
    assert await refs(conn, keys, p) is None


async def two_copies_claimed(
    conn: Connection, b: Binding, tag: bytes, max_attempts: int
) -> tuple[bytes, bytes, str, ClaimReply]:
    """A big payload (``tag``) uploaded and enqueued twice, both copies
    claimed by w1: (payload, stand-in, w1's incarnation, the claim)."""
    p, s = await uploaded(conn, b, tag)
    await b.enqueue(conn, Q, [s, s])
    inc = await join(b, conn, "w1", Q)
    return p, s, inc, await b.claim(conn, "w1", inc, Q, 2, max_attempts)


async def test_two_failed_copies_that_merge_in_the_delayed_set_keep_one_reference(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    p, s, _, c = await two_copies_claimed(conn, b, b"merge", 5)
    ids = [q.id for q in c.processes]
    # both fail with a backoff: one entry per payload waits in the delayed set
    out = await b.give_back(
        conn, "w1", Q, ids, failed=True, backoff_ms=60_000, backoff_cap_ms=60_000, errors=["E"] * 2
    )
    assert [o for o, _ in out] == [2, 2]
    assert await conn.execute("ZRANGE", keys.delayed(Q), 0, -1) == [s]
    assert await refs(conn, keys, p) == 1
    assert await mesh_cancel(conn, b, s) == 1
    assert await refs(conn, keys, p) is None


async def test_a_dead_workers_two_copies_that_merge_in_the_delayed_set_keep_one_reference(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    """Recycle's path (include/return_held.lua): a crashed worker's copies of
    one big payload on a later attempt wait for their backoff as one entry
    of the delayed set, and the copy that merged drops its reference."""
    p, s, inc, c = await two_copies_claimed(conn, b, b"crash", 10)
    # a first failure each, with no backoff: both back in the queue
    out = await b.give_back(
        conn, "w1", Q, [q.id for q in c.processes], failed=True, backoff_ms=0, errors=["E"] * 2
    )
    assert [o for o, _ in out] == [2, 2]
    c = await b.claim(conn, "w1", inc, Q, 2, 10, backoff_ms=60_000, backoff_cap_ms=60_000)
    assert [q.task for q in c.processes] == [s, s]
    assert await refs(conn, keys, p) == 2
    await expire_worker(conn, keys, "w1")
    r = await b.recycle(conn, "w1", leave=False)
    assert (r.alive, r.returned) == (False, 2)
    # the crash is a later attempt of each: both wait for the backoff, as one
    assert await conn.execute("ZRANGE", keys.delayed(Q), 0, -1) == [s]
    assert await conn.execute("LLEN", keys.queue(Q)) == 0
    assert await refs(conn, keys, p) == 1
    assert await mesh_cancel(conn, b, s) == 1
    assert await refs(conn, keys, p) is None


async def mesh_cancel(conn: Connection, b: Binding, payload: bytes) -> int:
    removed, cancelled = await b.cancel(conn, Q, payload)
    return removed + cancelled


async def test_a_persistent_big_task_counts_once_and_leaves_with_its_cancel(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    p = big(b"pers")
    await b.put_blobs(conn, [p])
    assert await b.ensure(conn, Q, [standin(p)], 1) == [True]
    assert await b.ensure(conn, Q, [standin(p)], 1) == [False]
    assert await refs(conn, keys, p) == 1
    inc = await join(b, conn, "w1", Q)
    c = await b.claim(conn, "w1", inc, Q, 1, 0)
    assert [q.task for q in c.processes] == [standin(p)]
    assert await refs(conn, keys, p) == 1
    assert await mesh_cancel(conn, b, standin(p)) == 1
    assert await refs(conn, keys, p) is None


# --- the client and the worker ----------------------------------------------------


async def test_a_big_payload_runs_with_its_exact_bytes_and_its_blob_leaves_when_finished(
    redis_url: str, namespace: str, conn: Connection, keys: Keys
) -> None:
    p = big(b"run")
    got: list[Process] = []
    ran = anyio.Event()

    async def handler(proc: Process) -> None:
        got.append(proc)
        ran.set()

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await client.enqueue(Q, p)
        # queued as its stand-in, one reference
        assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [standin(p)]
        assert await refs(conn, keys, p) == 1
        await w.start_work(Q, handler)
        with anyio.fail_after(10):
            await ran.wait()
        assert got[0].task == p

        async def gone() -> bool:
            return await refs(conn, keys, p) is None

        await wait_until(gone, within=5, what="the blob gone after the finish")


async def test_a_claimed_big_payload_whose_blob_is_gone_fails_and_never_reaches_the_handler(
    redis_url: str, namespace: str, conn: Connection, keys: Keys
) -> None:
    p = big(b"lost")
    ran: list[Process] = []

    async def handler(proc: Process) -> None:
        ran.append(proc)

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await client.enqueue(Q, p)
        await conn.execute("DEL", blob_key(keys, p))  # lost behind the mesh's back
        await w.start_work(Q, handler, max_attempts=1)

        async def dead() -> bool:
            return len(await client.dead_letters(Q)) == 1

        await wait_until(dead, within=10, what="the dead letter")
        (d,) = await client.dead_letters(Q)
        assert d.task == standin(p) and ran == []
        assert d.error.startswith("BlobGoneError: the big payload ")
        assert hashlib.sha1(p).hexdigest() in d.error and "is gone from Redis" in d.error


async def test_the_result_of_a_big_payload_is_found_by_the_payload(
    redis_url: str, namespace: str
) -> None:
    p = big(b"result")

    async def handler(proc: Process) -> bytes:
        return b"%d bytes" % len(proc.task)

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await client.configure(Q, result_ttl=60)
        await w.start_work(Q, handler)
        await client.enqueue(Q, p)
        with anyio.fail_after(10):
            assert await client.result(Q, p) == b"%d bytes" % len(p)


async def test_two_enqueues_of_one_big_payload_share_one_blob(
    redis_url: str, namespace: str, conn: Connection, keys: Keys
) -> None:
    p = big(b"shared")
    seen: list[bytes] = []

    async def handler(proc: Process) -> None:
        seen.append(proc.task)

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await client.enqueue(Q, p)
        await client.enqueue(Q, p)
        assert await refs(conn, keys, p) == 2
        assert await conn.execute("KEYS", f"{keys.prefix}blob:*") == [blob_key(keys, p).encode()]
        await w.start_work(Q, handler)
        await wait_until(lambda: len(seen) == 2, within=10, what="both copies run")
        assert seen == [p, p]

        async def gone() -> bool:
            return await refs(conn, keys, p) is None

        await wait_until(gone, within=5, what="the blob gone after both finished")


async def test_cancelled_while_queued_or_running_its_blob_is_gone(
    redis_url: str, namespace: str, conn: Connection, keys: Keys
) -> None:
    queued, running = big(b"queued"), big(b"running")
    started = anyio.Event()
    cancelled = anyio.Event()

    async def handler(proc: Process) -> None:
        assert proc.task == running
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await client.enqueue(Q, queued)
        assert await client.cancel(Q, queued) == 1
        assert await refs(conn, keys, queued) is None
        await client.enqueue(Q, running)
        await w.start_work(Q, handler)
        with anyio.fail_after(10):
            await started.wait()
        assert await refs(conn, keys, running) == 1
        assert await client.cancel(Q, running) == 1
        assert await refs(conn, keys, running) is None
        with anyio.fail_after(10):
            await cancelled.wait()


async def test_dead_lettered_keeps_the_blob_requeue_runs_it_purge_drops_it(
    redis_url: str, namespace: str, conn: Connection, keys: Keys
) -> None:
    p = big(b"doomed")
    runs: list[bytes] = []
    fail = True

    async def handler(proc: Process) -> None:
        runs.append(proc.task)
        if fail:
            raise RuntimeError("fails on purpose")

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work(Q, handler, max_attempts=1)
        await client.enqueue(Q, p)

        async def dead() -> bool:
            return len(await client.dead_letters(Q)) == 1

        await wait_until(dead, within=10, what="the dead letter")
        assert runs == [p]
        assert await refs(conn, keys, p) == 1  # kept with its dead letter
        fail = False
        assert await client.requeue_dead(Q, [p]) == 1
        await wait_until(lambda: len(runs) == 2, within=10, what="the requeued run")
        assert runs[1] == p

        async def gone() -> bool:
            return await refs(conn, keys, p) is None

        await wait_until(gone, within=5, what="the blob gone after the requeued run")
        fail = True
        await client.enqueue(Q, p)
        await wait_until(dead, within=10, what="dead-lettered again")
        assert await refs(conn, keys, p) == 1
        assert await client.purge_dead(Q, [p]) == 1
        assert await refs(conn, keys, p) is None


async def test_a_stand_in_that_a_read_gave_names_its_big_payload(
    redis_url: str, namespace: str, conn: Connection, keys: Keys
) -> None:
    p = big(b"named")
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue(Q, p)
        (held,) = await client.tasks(Q)  # raw reads give what the queue holds
        assert held == standin(p)
        found = await client.job(Q, held)
        assert found is not None and (found.task, found.size, found.whole) == (
            p[:256],
            len(p),
            False,
        )
        assert await client.cancel(Q, held) == 1
        assert await refs(conn, keys, p) is None
        # but a stand-in is never added as a task, nor a look-alike named
        with pytest.raises(ValueError, match="mesh-blob"):
            await client.enqueue(Q, held)
        with pytest.raises(ValueError, match="is no stand-in"):
            await client.cancel(Q, BLOB_MARK + b"x")


async def test_delete_queue_drops_every_blob_of_the_queue(
    redis_url: str, namespace: str, conn: Connection, keys: Keys
) -> None:
    a, c, d, e = big(b"a"), big(b"c"), big(b"d"), big(b"e")
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue_many(Q, [a, a])
        await client.ensure(Q, c)
        await client.enqueue(Q, d, delay=3600)
        await client.enqueue(Q, e, group="g1")
        await client.enqueue("other", a)  # another queue's copy keeps the blob
        assert [await refs(conn, keys, x) for x in (a, c, d, e)] == [3, 1, 1, 1]
        await client.delete_queue(Q)
        assert [await refs(conn, keys, x) for x in (a, c, d, e)] == [1, None, None, None]


async def test_reads_show_the_preview_and_size_and_fetch_the_whole_on_request(
    redis_url: str, namespace: str
) -> None:
    p = big(b"look")
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue(Q, p)
        page = await client.jobs(Q, "queued")
        (j,) = page.jobs
        assert (j.task, j.size, j.whole) == (p[:256], len(p), False)
        assert j.ref is not None
        assert await _browse.payload(client._reads, Q, j.ref) == p
        found = await client.job(Q, p)
        assert found is not None and found.state == "queued" and found.task == p and found.whole


@pytest.mark.trio_only("the mesh command and the dashboard: a subprocess and an HTTP server")
async def test_the_cli_and_the_dashboard_show_a_preview_and_the_size_and_download_it_whole(
    redis_url: str, namespace: str
) -> None:
    import json
    import urllib.request

    import trio

    from mesh.dashboard import serve_dashboard

    from .browser import http
    from .cli_helpers import mesh_cli, text

    p = b"shown:" + b"x" * (3 * MIB)  # text: the listings show it as such
    ns = ["--redis", redis_url, "--namespace", namespace]
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue(Q, p)
        r = await mesh_cli("jobs", Q, "--state", "queued", "--json", *ns)
        assert r.returncode == 0, text(r)
        (row,) = json.loads(r.stdout)["jobs"]
        assert (row["task"]["data"], row["size"], row["whole"]) == (p[:256].decode(), len(p), False)
        async with serve_dashboard(client, interval=0.2) as url:
            status, body = await trio.to_thread.run_sync(
                lambda: http(url + f"api/jobs?queue={Q}&state=queued")
            )
            assert status == 200
            (j,) = json.loads(body)["jobs"]
            assert j["size"] == len(p) and len(body) < 5000  # a preview, not 3 MiB
            assert j["task"].startswith("shown:xxx")
            ref = j["ref"]

            def download() -> bytes:
                with urllib.request.urlopen(f"{url}api/payload?queue={Q}&ref={ref}") as r:
                    return bytes(r.read())

            assert await trio.to_thread.run_sync(download) == p


@pytest.mark.trio_only("the dashboard: an HTTP server")
async def test_the_dashboards_details_and_actions_on_a_big_payload_never_read_its_blob(
    redis_url: str, namespace: str, conn: Connection, keys: Keys
) -> None:
    """A job's details, its cancel and a dead letter's requeue name a big
    payload by its stand-in (what the queue holds): Redis sends no blob for
    them (its bytes sent grow by far less than the payload); "run now" of a
    delayed one enqueues the whole payload again, its blob kept."""
    import json

    import trio

    from mesh.dashboard import serve_dashboard

    from .browser import http

    p, later = big(b"details"), big(b"later")
    act = {"Content-Type": "application/json", "X-Mesh-Action": "1"}

    async def sent() -> int:
        stats = await conn.execute("INFO", "stats")
        text = stats.decode() if isinstance(stats, bytes) else str(stats)
        return int(text.split("total_net_output_bytes:")[1].split()[0])

    async def get(url: str) -> dict[str, Any]:
        status, body = await trio.to_thread.run_sync(lambda: http(url))
        assert status == 200, body
        return dict(json.loads(body))

    async def post(url: str, body: dict[str, str]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        status, text = await trio.to_thread.run_sync(lambda: http(url, data=data, headers=act))
        assert status == 200, text
        return dict(json.loads(text))

    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue(Q, p)
        await client.enqueue(Q, later, delay=3600)
        async with serve_dashboard(client, interval=0.2) as url:
            (row,) = (await get(url + f"api/jobs?queue={Q}&state=queued"))["jobs"]
            before = await sent()
            details = await get(url + f"api/job?queue={Q}&ref={row['ref']}")
            assert (details["state"], details["size"]) == ("queued", len(p))
            assert await sent() - before < MIB  # not the 3 MiB payload
            before = await sent()
            assert await post(url + "api/cancel", {"queue": Q, "ref": row["ref"]}) == {
                "cancelled": 1
            }
            assert await sent() - before < MIB
            assert await refs(conn, keys, p) is None and await client.job(Q, p) is None
            (d,) = (await get(url + f"api/jobs?queue={Q}&state=delayed"))["jobs"]
            assert await post(url + "api/job/run", {"queue": Q, "ref": d["ref"]}) == {"due": True}
            job = await client.job(Q, later)
            assert job is not None and job.state in ("queued", "delayed")
            assert await refs(conn, keys, later) == 1  # one copy, its blob kept


async def test_a_big_payload_in_a_group_at_a_priority_counts_through_retry_dead_and_requeue(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    # A group's job with a priority whose payload is big: its stand-in sits
    # in the group's priority set, merges once in the group's delayed set
    # (two failed copies), keeps its reference as a dead letter, goes back to
    # its group and priority on requeue, and leaves with its last copy.
    p, s = await uploaded(conn, b, b"grouped")
    await b.enqueue_group(conn, Q, "t", [s, s], priority=6)
    assert await refs(conn, keys, p) == 2
    inc = await join(b, conn, "w1", Q)
    ids = [q.id for q in (await b.claim(conn, "w1", inc, Q, 2, 5, backoff_ms=0)).processes]
    out = await b.give_back(
        conn, "w1", Q, ids, failed=True, backoff_ms=60_000, backoff_cap_ms=60_000, errors=["E"] * 2
    )
    assert [o for o, _ in out] == [2, 2]
    assert await conn.execute("ZRANGE", keys.group_delayed(Q), 0, -1) == [b"t\0r6" + s]
    assert await refs(conn, keys, p) == 1
    await conn.execute("ZADD", keys.group_delayed(Q), 0, b"t\0r6" + s)  # due now
    # (the two copies share the payload's count of failed attempts: 2)
    (q,) = (await b.claim(conn, "w1", inc, Q, 2, 3, backoff_ms=0)).processes
    assert (q.task, q.group, q.attempts) == (s, "t", 2)
    assert await b.give_back(conn, "w1", Q, [q.id], failed=True, errors=["E"]) == [(3, 0)]
    assert await refs(conn, keys, p) == 1  # kept with its dead letter
    assert await b.dead(conn, Q, "requeue", None) == (1, 0)
    (m,) = await conn.execute("ZRANGE", keys.group_prio(Q, "t"), 0, -1)
    assert m[:1] == b"6" and m[16:] == s
    assert await mesh_cancel_group(conn, b, s, "t") == 1
    assert await refs(conn, keys, p) is None


async def mesh_cancel_group(conn: Connection, b: Binding, payload: bytes, group: str) -> int:
    removed, cancelled = await b.cancel(conn, Q, payload, group)
    return removed + cancelled
