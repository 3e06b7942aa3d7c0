"""Enqueue times of one-shot jobs (a queue's policy ``enqueue_times``,
``include/enqueue_time.lua``) against a real redis-server: kept for every
path that enqueues a one-shot job, through claim, retry, hand-back and
recycle; gone when the job leaves for good; never written for a queue that
does not keep them; read by :meth:`Client.jobs` and :meth:`Client.job`."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import mesh
from mesh import ConfigError
from mesh._binding import Binding
from mesh._connection import Connection
from mesh._keys import Keys
from mesh.dashboard import serve_dashboard

from .browser import OVERFLOWS, chromium, in_page, page_until
from .cli_helpers import run_main
from .helpers import redis_ms
from .protocol_helpers import expire_worker, join

pytestmark = pytest.mark.both_loops

Q = "timed"


async def _timed(b: Binding, conn: Connection, queue: str = Q, on: bool = True) -> None:
    await b.configure(conn, queue, "set", "configure", ["enqueue_times", int(on)])


async def _times(conn: Connection, keys: Keys, queue: str = Q) -> dict[bytes, int]:
    flat = await conn.execute("ZRANGE", keys.enqt(queue), 0, -1, "WITHSCORES")
    return {flat[i]: int(float(flat[i + 1])) for i in range(0, len(flat), 2)}


async def test_every_enqueue_path_keeps_the_first_time(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await _timed(b, conn)
    assert await conn.execute("SISMEMBER", keys.timed(), Q) == 1
    before = await redis_ms(conn)
    await b.enqueue(conn, Q, [b"list"])
    await b.enqueue(conn, Q, [b"prio"], priority=5)
    await b.enqueue_group(conn, Q, "g1", [b"group"])
    await b.enqueue_group(conn, Q, "g1", [b"group-later"], in_ms=60_000)
    await b.delay(conn, Q, [b"delayed"], in_ms=60_000)
    await b.schedule(conn, Q, b"tick", "every 1000", before - 1)
    sid = Q.encode() + b"\0tick"
    assert await b.fire(conn, [(sid, before - 1, before + 999_999)]) == [1]
    after = await redis_ms(conn)
    t = await _times(conn, keys)
    assert set(t) == {b"list", b"prio", b"group", b"group-later", b"delayed", b"tick"}
    assert all(before <= v <= after for v in t.values())
    # a payload queued twice keeps its first time (ZADD NX)
    await conn.execute("ZADD", keys.enqt(Q), "XX", 1, b"list")
    await b.enqueue(conn, Q, [b"list"])
    assert (await _times(conn, keys))[b"list"] == 1


async def test_times_survive_claim_retry_hand_back_and_recycle(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await _timed(b, conn)
    await b.enqueue(conn, Q, [b"a", b"b", b"c"])
    first = await _times(conn, keys)
    assert set(first) == {b"a", b"b", b"c"}
    inc = await join(b, conn, "w1", Q)
    c = await b.claim(conn, "w1", inc, Q, 3, 5)
    ids = {p.task: p.id for p in c.processes}
    assert await _times(conn, keys) == first  # running: kept
    await b.give_back(conn, "w1", Q, [ids[b"a"]], failed=True)  # a retry (no backoff: the back)
    await b.give_back(conn, "w1", Q, [ids[b"b"]], failed=False)  # handed back
    assert await _times(conn, keys) == first
    await expire_worker(conn, keys, "w1")
    await b.recycle(conn, "w1", leave=False)  # c: recycled to the front
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"c", b"b", b"a"]
    assert await _times(conn, keys) == first


async def test_times_leave_with_the_job_and_the_key_with_the_last(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await _timed(b, conn)
    await b.enqueue(conn, Q, [b"done", b"fin2", b"dies", b"crash", b"gone"])
    await b.enqueue_group(conn, Q, "g", [b"gdone"])
    inc = await join(b, conn, "w1", Q)
    c = await b.claim(conn, "w1", inc, Q, 6, 1)
    ids = {p.task: p.id for p in c.processes}
    assert len(ids) == 6
    # finish (finish.lua), and finish_claim's finish
    assert await b.finish(conn, "w1", inc, Q, [ids[b"done"], ids[b"gdone"]]) == [True, True]
    f, _ = await b.finish_and_claim(
        conn, "w1", inc, Q, [ids[b"fin2"]], b.claim_call("w1", inc, Q, 1, 1)
    )
    assert f.unwrap() == [True]
    assert set(await _times(conn, keys)) == {b"dies", b"crash", b"gone"}
    # dead-lettered by a failure at the attempt limit (give_back)
    await b.give_back(conn, "w1", Q, [ids[b"dies"]], failed=True)
    assert set(await _times(conn, keys)) == {b"crash", b"gone"}
    # cancelled while running
    await b.cancel(conn, Q, b"gone")
    assert set(await _times(conn, keys)) == {b"crash"}
    # dead-lettered by recycle (a crash at the attempt limit)
    await expire_worker(conn, keys, "w1")
    await b.recycle(conn, "w1", leave=False)
    assert await conn.execute("EXISTS", keys.enqt(Q)) == 0
    # a requeued dead letter gets a new time; a purge leaves none behind
    before = await redis_ms(conn)
    assert await b.dead(conn, Q, "requeue", [b"crash"]) == (1, 0)
    assert (await _times(conn, keys))[b"crash"] >= before
    await b.cancel(conn, Q, b"crash")  # queued: cancelled
    await b.dead(conn, Q, "purge", None)
    assert await conn.execute("EXISTS", keys.enqt(Q)) == 0


async def test_delete_queue_and_turning_off_drop_the_times(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await _timed(b, conn)
    await b.enqueue(conn, Q, [b"a"])
    await b.delete_queue(conn, Q)
    assert await conn.execute("EXISTS", keys.enqt(Q)) == 0
    # the policy belongs to the name (as a pause does): still timed
    await b.enqueue(conn, Q, [b"b"])
    assert set(await _times(conn, keys)) == {b"b"}
    await _timed(b, conn, on=False)
    assert await conn.execute("EXISTS", keys.enqt(Q)) == 0
    assert await conn.execute("SISMEMBER", keys.timed(), Q) == 0
    await _timed(b, conn)
    await b.configure(conn, Q, "clear", "", [])
    assert await conn.execute("SISMEMBER", keys.timed(), Q) == 0


async def test_a_queue_that_does_not_keep_them_never_writes_the_key(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await b.configure(conn, Q, "set", "configure", ["max_attempts", 1])  # no enqueue_times
    await b.enqueue(conn, Q, [b"a"])
    await b.enqueue(conn, Q, [b"p"], priority=3)
    await b.enqueue_group(conn, Q, "g", [b"g"])
    await b.delay(conn, Q, [b"d"], in_ms=10)
    inc = await join(b, conn, "w1", Q)
    c = await b.claim(conn, "w1", inc, Q, 5, 1)
    await b.finish(conn, "w1", inc, Q, [p.id for p in c.processes])
    assert await conn.execute("EXISTS", keys.enqt(Q), keys.timed()) == 0


async def test_client_reads_and_shows_the_times(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        with pytest.raises(ConfigError, match="enqueue_times must be True or False"):
            await client.configure(Q, enqueue_times="yes")  # type: ignore[arg-type]
        assert (await client.policy(Q)) is None  # nothing was written
        policy = await client.configure(Q, enqueue_times=True)
        assert policy.enqueue_times
        now = await client.time()
        await client.enqueue_many(Q, ["q1", "x" * 2000])
        await client.enqueue(Q, "d1", delay=3600)
        await client.enqueue(Q, "g1", group="g")
        await client.enqueue(Q, "g2", group="g", delay=3600)
        page = await client.jobs(Q, "queued")
        assert [j.size for j in page.jobs] == [2, 2000]
        assert all(j.enqueued is not None and abs(j.enqueued - now) < 5 for j in page.jobs)
        (d,) = (await client.jobs(Q, "delayed")).jobs
        assert d.enqueued is not None and abs(d.enqueued - now) < 5
        for state in ("queued", "delayed"):
            (g,) = (await client.jobs(Q, state, group="g")).jobs
            assert g.enqueued is not None and abs(g.enqueued - now) < 5
        j = await client.job(Q, "x" * 2000)
        assert j is not None and j.enqueued == page.jobs[1].enqueued
        # an untimed queue: None, as before
        await client.enqueue("plain", "p")
        (p,) = (await client.jobs("plain", "queued")).jobs
        assert p.enqueued is None


@pytest.mark.trio_only("mesh.cli.main runs its own loop")
def test_cli_configures_and_shows_the_times(
    capsys: pytest.CaptureFixture[str], redis_url: str, namespace: str
) -> None:
    ns = ["--redis", redis_url, "--namespace", namespace]
    code, _, err = run_main(capsys, "configure", Q, "--enqueue-times", "yes", *ns)
    assert code == 2 and "--enqueue-times: expected on or off, got 'yes'" in err
    code, out, _ = run_main(capsys, "configure", Q, "--enqueue-times", "on", *ns)
    assert code == 0 and "enqueue_times=on" in out
    code, out, _ = run_main(capsys, "configure", Q, "--json", *ns)
    assert json.loads(out)["policy"]["enqueue_times"] is True

    async def fill() -> None:
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            await client.enqueue_many(Q, ["a", "b"])
            await client.enqueue(Q, "later", delay=3600)
            await client.enqueue("plain", "p")

    trio.run(fill)
    code, out, _ = run_main(capsys, "jobs", Q, "--state", "queued", *ns)
    rows = out.splitlines()
    assert code == 0 and rows[1].split()[-3:] == ["WAITING", "SINCE", "(UTC)"]
    assert all(r.split()[-1].count(":") == 2 for r in rows[2:4]), out  # a time, not "-"
    code, out, _ = run_main(capsys, "jobs", Q, "--state", "delayed", *ns)
    assert code == 0 and "ENQUEUED (UTC)" in out and "not kept" not in out
    code, out, _ = run_main(capsys, "job", Q, "a", *ns)
    assert code == 0 and "waiting since:" in out
    # a queue that keeps none says so, in place of a bare "-"
    code, out, _ = run_main(capsys, "jobs", "plain", "--state", "queued", *ns)
    assert out.splitlines()[-1] == (
        "enqueue times: not kept (mesh configure plain --enqueue-times on)"
    )
    code, out, _ = run_main(capsys, "job", "plain", "p", *ns)
    assert "enqueued:" in out and "--enqueue-times on" in out
    code, out, _ = run_main(capsys, "status", *ns)
    assert code == 0 and f"ENQUEUE TIMES kept for: {Q}" in out.splitlines(), out


@pytest.mark.slow
@pytest.mark.trio_only("selenium in threads, as the other dashboard tests")
async def test_dashboard_shows_the_times_and_says_where_none_are_kept(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        conn, b = client._conn, Binding(client._keys)
        await client.configure("emails", enqueue_times=True)
        inc = await join(b, conn, "worker-eu-west-1a-7f3c", "emails")
        await client.enqueue_many(
            "emails", ["welcome:ada@example.com", "welcome:grace@example.com"]
        )
        await b.claim(conn, "worker-eu-west-1a-7f3c", inc, "emails", 1, 3)
        await client.enqueue_many(
            "emails", [f"newsletter:user-{i:04d}@example.com" for i in range(5)]
        )
        await client.enqueue("emails", "reminder:invoice-7", delay=600)
        await client.enqueue_many("reports", ["weekly-usage"])
        header = {"redis": mesh.parse_url(redis_url).redacted(), "namespace": namespace}
        async with serve_dashboard(client, interval=0.2, header=header) as url:
            with chromium(1280, 900) as driver:
                rows = "Array.from(document.querySelectorAll('#jobs tbody tr'))"
                cells = f"{rows}.map(r => Array.from(r.cells).map(c => c.textContent))"
                th = "document.querySelectorAll('#jobs thead th')"
                heads = f"Array.from({th}).map(h => h.textContent)"
                await in_page(driver, lambda d: d.get(url + "#/queue/emails"))
                await page_until(driver, f"{rows}.length === 6", what="six queued jobs")
                head = await in_page(driver, lambda d: d.execute_script("return " + heads))
                col = head.index("waiting since (UTC)")
                got = await in_page(driver, lambda d: d.execute_script("return " + cells))
                assert all(r[col].count(":") == 2 for r in got), got  # a UTC time each
                await no_overflow(driver)
                shots = Path(os.environ.get("MESH_CONSOLE_SCREENSHOTS") or tmp_path)
                await shot(driver, shots / "dashboard-enqueued.png")
                for state in ("running", "delayed"):
                    click = f"document.querySelector('#q-tabs button[data-state={state}]').click()"
                    await in_page(driver, _js(click))
                    await page_until(
                        driver, f"{rows}.length === 1 && {heads}.includes('enqueued (UTC)')"
                    )
                    head = await in_page(driver, lambda d: d.execute_script("return " + heads))
                    got = await in_page(driver, lambda d: d.execute_script("return " + cells))
                    assert got[0][head.index("enqueued (UTC)")].count(":") == 2, (state, got)
                # the job's details
                await in_page(driver, lambda d: d.execute_script(
                    "document.querySelector('#jobs tbody a').click()"
                ))  # fmt: skip
                detail = "document.querySelector('#job-body dl.detail')?.textContent || ''"
                await page_until(driver, f"({detail}).includes('enqueued (UTC)')", what="details")
                await no_overflow(driver)
                await shot(driver, shots / "dashboard-enqueued-job.png")
                # a queue that keeps none: "not kept", with the command in the tooltip
                await in_page(driver, lambda d: d.get(url + "#/queue/reports"))
                await page_until(
                    driver, f"{rows}.length === 1 && {rows}[0].dataset.task === 'weekly-usage'"
                )
                cell = f"{rows}[0].cells[5]"
                assert (
                    await in_page(driver, lambda d: d.execute_script(f"return {cell}.innerText"))
                    == "not kept"
                )
                tip = await in_page(driver, lambda d: d.execute_script(f"return {cell}.title"))
                assert tip == "not kept: mesh configure reports --enqueue-times on"
                note = await in_page(driver, lambda d: d.find_element("id", "enqt-note").text)
                assert note == "enqueue times not kept: mesh configure reports --enqueue-times on"
                await shot(driver, shots / "dashboard-not-kept.png")


def _js(script: str) -> Callable[[Any], Any]:
    """A selenium call that runs ``script`` in the page (for :func:`in_page`)."""
    return lambda d: d.execute_script(script)


async def no_overflow(driver: object) -> None:
    bad = await in_page(driver, lambda d: d.execute_script(OVERFLOWS))
    assert bad == [], bad


async def shot(driver: object, path: Path) -> None:
    height = await in_page(driver, lambda d: d.execute_script("return document.body.scrollHeight"))
    await in_page(driver, lambda d: d.set_window_size(1280, min(int(height) + 120, 4000)))
    await in_page(driver, lambda d: d.save_screenshot(str(path)))
    assert (await trio.Path(path).stat()).st_size > 10_000
