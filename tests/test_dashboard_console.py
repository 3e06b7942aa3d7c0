"""The dashboard as an operator's console, in Debian's headless Chromium
(selenium): the queue page with its jobs by state (paged, searched), a job's
details with its error, actions over POST (requeue a dead job, delete, pause
and resume), charts from counts kept in Redis, schedules and the next delayed
jobs, times in UTC, and nothing cut off from 1280 to 1920 px wide.

``MESH_CONSOLE_SCREENSHOTS=DIR`` keeps the screenshots (docs/img/ holds
those of the docs)."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import mesh
from mesh._binding import Binding
from mesh._history import CountsReporter
from mesh._stats import Recorder
from mesh.dashboard import serve_dashboard

from .browser import OVERFLOWS, chromium, http, in_page, page_until

EVIL = "<img src=x onerror=window.__pwned=1>"


async def populate(client: mesh.Client) -> None:
    """A mesh with something in every table: a worker (registered by hand,
    so nothing moves) running two jobs and three devices, 30 queued jobs,
    dead letters (one with HTML in its payload and error), delayed jobs,
    schedules, a paused queue, and an hour of per-minute counts."""
    conn, b = client._conn, Binding(client._keys)
    k = client._keys
    inc = "inc-1"
    info = json.dumps({"host": "app-eu-west-1a", "pid": 4242}).encode()
    await b.register(conn, "worker-eu-west-1a-7f3c", inc, 600_000, info)
    for q in ("emails", "devices"):
        await b.serve(conn, "worker-eu-west-1a-7f3c", inc, q)
    await client.enqueue_many("emails", [f"welcome:user-{i:04d}@example.com" for i in range(2)])
    await b.claim(conn, "worker-eu-west-1a-7f3c", inc, "emails", 2, 3)
    await client.ensure_many("devices", ["sensor-berlin-01", "sensor-paris-02", "sensor-oslo-03"])
    await b.claim(conn, "worker-eu-west-1a-7f3c", inc, "devices", 3, 0)
    doomed = ["bounce:ada@example.com", EVIL, "bounce:grace@example.com"]
    await client.enqueue_many("emails", doomed)
    c = await b.claim(conn, "worker-eu-west-1a-7f3c", inc, "emails", 3, 1)
    errors = [
        "SMTPRecipientsRefused: {'ada@example.com': (550, b'5.1.1 user unknown')}",
        "ValueError: " + EVIL,
        "TimeoutError: the handler ran for more than 30 s",
    ]
    await b.give_back(
        conn, "worker-eu-west-1a-7f3c", "emails", [p.id for p in c.processes], failed=True,
        errors=errors,
    )  # fmt: skip
    await client.enqueue_many("emails", [f"newsletter:user-{i:04d}@example.com" for i in range(30)])
    for i in range(4):
        await client.enqueue("emails", f"reminder:invoice-{i}", delay=600 * (i + 1))
    await client.enqueue_many("reports", ["weekly-usage", "monthly-billing"])
    await client.pause("reports")
    await client.schedule("reports", "daily-summary", every=86400)
    await client.schedule("emails", "digest:hourly", every=3600)
    minute = int((await conn.execute("TIME"))[0]) // 60
    fields: list[Any] = []
    for m in range(minute - 59, minute + 1):
        fields += [f"p{m}", 40 + (m * 37) % 60, f"f{m}", (m * 13) % 7 if m % 3 else 0]
    await conn.execute("HSET", k.stats("emails"), ":min", minute - 59, *fields)


@asynccontextmanager
async def console(url: str, namespace: str, **kw: Any) -> AsyncIterator[tuple[mesh.Client, str]]:
    async with mesh.open_client(url, namespace=namespace) as client:
        header = {"redis": mesh.parse_url(url).redacted(), "namespace": namespace}
        async with serve_dashboard(client, interval=0.2, header=header, **kw) as page:
            yield client, page


def open_job(task: str) -> str:
    """JavaScript: click the link of the job row whose payload is ``task``."""
    return (
        "Array.from(document.querySelectorAll('#jobs tbody tr'))"
        f".find(r => r.dataset.task === {json.dumps(task)}).querySelector('a').click()"
    )


def shots_dir(tmp_path: Path) -> Path:
    d = os.environ.get("MESH_CONSOLE_SCREENSHOTS")
    return Path(d) if d else tmp_path


async def no_overflow(driver: Any, where: str) -> None:
    bad = await in_page(driver, lambda d: d.execute_script(OVERFLOWS))
    assert bad == [], f"{where}: {bad}"


async def screenshot(driver: Any, path: Path) -> None:
    # the whole page, not only the window
    height = await in_page(driver, lambda d: d.execute_script("return document.body.scrollHeight"))
    width = await in_page(driver, lambda d: d.execute_script("return window.innerWidth"))
    await in_page(driver, lambda d: d.set_window_size(width, min(int(height) + 120, 4000)))
    await in_page(driver, lambda d: d.execute_script("window.scrollTo(0, 0)"))
    await in_page(driver, lambda d: d.save_screenshot(str(path)))
    assert (await trio.Path(path).stat()).st_size > 10_000


@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 1600, 1920])
async def test_nothing_is_cut_off_and_times_are_utc(
    redis_url: str, namespace: str, tmp_path: Path, width: int
) -> None:
    async with console(redis_url, namespace) as (client, url):
        await populate(client)
        with chromium(width, 1000) as driver:
            await in_page(driver, lambda d: d.get(url))
            await page_until(driver, "document.querySelectorAll('#queues tbody tr').length === 3")
            await page_until(
                driver, "document.querySelectorAll('#schedules tbody tr').length === 2"
            )
            await page_until(driver, "document.querySelectorAll('#delayed tbody tr').length === 4")
            await page_until(
                driver, "document.querySelectorAll('#chart-finished rect').length > 30"
            )
            # the paused queue says so, with a resume button
            reports = await page_until(
                driver,
                "Array.from(document.querySelectorAll('#queues tbody tr'))"
                ".find(r => r.dataset.queue === 'reports')?.innerText",
            )
            assert "paused" in reports and "resume" in reports
            # UTC, as the CLI: 2026-01-02 03:04:05 UTC, no AM/PM
            now = await in_page(driver, lambda d: d.find_element("id", "now").text)
            assert now.endswith(" UTC") and len(now) == len("2026-01-02 03:04:05 UTC"), now
            nxt = await page_until(
                driver, "document.querySelector('#schedules tbody td:nth-child(4)')?.innerText"
            )
            assert len(nxt) == 19 and "M" not in nxt, nxt
            await no_overflow(driver, f"overview at {width} px")
            if width in (1280, 1920):
                await screenshot(driver, shots_dir(tmp_path) / f"dashboard-{width}.png")
                await in_page(driver, lambda d: d.set_window_size(width, 1000))
            # the queue page, dead letters with the job's details
            await in_page(driver, lambda d: d.get(url + "#/queue/emails"))
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 25")
            await no_overflow(driver, f"queued jobs at {width} px")
            await in_page(
                driver,
                lambda d: d.execute_script(
                    "document.querySelector('#q-tabs button[data-state=dead]').click()"
                ),
            )
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 3")
            await in_page(driver, lambda d: d.execute_script(open_job("bounce:ada@example.com")))
            err = await page_until(driver, "document.getElementById('job-error')?.innerText")
            assert "550" in err and "user unknown" in err
            await no_overflow(driver, f"job details at {width} px")
            if width in (1280, 1920):
                await screenshot(driver, shots_dir(tmp_path) / f"dashboard-queue-{width}.png")


@pytest.mark.slow
async def test_queue_page_pages_searches_and_acts(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    async with console(redis_url, namespace) as (client, url):
        await populate(client)
        with chromium(1400, 1000) as driver:
            await in_page(driver, lambda d: d.get(url))
            # from the overview to the queue page by its link
            await page_until(driver, "document.querySelector('#queues a.queue-link')")
            await in_page(
                driver,
                lambda d: d.execute_script(
                    "Array.from(document.querySelectorAll('#queues a.queue-link'))"
                    ".find(a => a.textContent === 'emails').click()"
                ),
            )
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 25")
            first = await in_page(
                driver,
                lambda d: d.execute_script(
                    "return document.querySelector('#jobs tbody tr').dataset.task"
                ),
            )
            assert first == "newsletter:user-0000@example.com"
            # page 2: the 5 others of the 30
            await in_page(driver, lambda d: d.find_element("id", "page-next").click())
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 5")
            note = await in_page(driver, lambda d: d.find_element("id", "page-note").text)
            assert note == "page 2 of 2 (last)"
            # search by payload prefix
            await in_page(
                driver, lambda d: d.find_element("id", "search").send_keys("newsletter:user-001")
            )
            await in_page(driver, lambda d: d.execute_script(
                "document.querySelector('#search-form button[type=submit]').click()"
            ))  # fmt: skip
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 10")
            # the dead letter with HTML in it is shown as text, never run
            await in_page(driver, lambda d: d.execute_script(
                "document.getElementById('search-clear').click();"
                "document.querySelector('#q-tabs button[data-state=dead]').click()"
            ))  # fmt: skip
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 3")
            texts = await in_page(driver, lambda d: d.find_element("id", "jobs").text)
            assert EVIL in texts
            assert (
                await in_page(driver, lambda d: d.execute_script("return window.__pwned")) is None
            )
            assert await in_page(driver, lambda d: d.execute_script(
                "return document.querySelectorAll('#jobs img').length"
            )) == 0  # fmt: skip
            # requeue a dead job from its row: confirm, and it is queued again
            await in_page(driver, lambda d: d.execute_script(
                "window.confirm = () => true;"
                "Array.from(document.querySelectorAll('#jobs tbody tr'))"
                ".find(r => r.dataset.task === 'bounce:grace@example.com')"
                ".querySelector('button.job-requeue').click()"
            ))  # fmt: skip
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 2")
            j = await client.job("emails", "bounce:grace@example.com")
            assert j is not None and j.state == "queued" and j.attempts == 0
            # delete a dead job from its details view
            await in_page(driver, lambda d: d.execute_script(open_job(EVIL)))
            await page_until(driver, "document.querySelector('#job-actions button.job-delete')")
            await in_page(driver, lambda d: d.execute_script(
                "window.confirm = () => true;"
                "document.querySelector('#job-actions button.job-delete').click()"
            ))  # fmt: skip
            await page_until(
                driver, "document.getElementById('job-body').innerText.includes('not on the queue')"
            )
            assert await client.job("emails", EVIL) is None
            # pause and resume from the queue page
            await in_page(driver, lambda d: d.execute_script("window.confirm = () => true;"))
            await in_page(driver, lambda d: d.find_element("id", "q-pause").click())
            await page_until(driver, "!document.getElementById('q-paused').hidden")
            assert (await client.queue_info("emails")).paused
            await page_until(driver, "document.getElementById('q-pause').textContent === 'Resume'")
            await in_page(driver, lambda d: d.find_element("id", "q-pause").click())
            await page_until(driver, "document.getElementById('q-paused').hidden")
            assert not (await client.queue_info("emails")).paused


async def test_actions_need_the_action_header_and_the_token(redis_url: str, namespace: str) -> None:
    async with console(redis_url, namespace, token="t0ken") as (client, url):
        await client.enqueue("q", "x")
        body = json.dumps({"queue": "q"}).encode()
        auth = {"Authorization": "Bearer t0ken", "Content-Type": "application/json"}
        json_only = {"Content-Type": "application/json"}
        for path in ("api/pause", "api/resume"):
            status, _ = await trio.to_thread.run_sync(http, url + path, body, json_only)
            assert status == 401
            status, _ = await trio.to_thread.run_sync(http, url + path, body, auth)
            assert status == 403
        assert not (await client.queue_info("q")).paused
        status, text = await trio.to_thread.run_sync(
            lambda: http(url + "api/pause", data=body, headers={**auth, "X-Mesh-Action": "1"})
        )
        assert status == 200 and json.loads(text)["changed"] is True
        assert (await client.queue_info("q")).paused
        status, _ = await trio.to_thread.run_sync(lambda: http(url + "api/jobs?queue=q"))
        assert status == 401
        status, text = await trio.to_thread.run_sync(
            lambda: http(url + "api/jobs?queue=q&state=queued", headers=auth)
        )
        assert status == 200 and [j["task"] for j in json.loads(text)["jobs"]] == ["x"]
        status, text = await trio.to_thread.run_sync(
            lambda: http(url + "api/jobs?queue=q&state=nope", headers=auth)
        )
        assert status == 400 and "state" in json.loads(text)["error"]
        b64 = base64.b64encode(b"x").decode()
        delete = json.dumps({"queue": "q", "task_b64": b64}).encode()
        status, _ = await trio.to_thread.run_sync(
            lambda: http(url + "api/job/delete", data=delete, headers=auth)
        )
        assert status == 403
        status, text = await trio.to_thread.run_sync(
            lambda: http(
                url + "api/job/delete", data=delete, headers={**auth, "X-Mesh-Action": "1"}
            )
        )
        assert status == 200 and json.loads(text) == {"deleted": 1}
        assert await client.job("q", "x") is None


async def test_charts_survive_a_restarted_dashboard(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue("q", "x")  # a known queue
        rec = Recorder()
        rec.queue("q").finished += 12
        rec.queue("q").failed += 3
        assert await CountsReporter(client._conn, Binding(client._keys), lambda: (rec,)).report()
    for _ in range(2):  # a dashboard, stopped, then another
        async with console(redis_url, namespace) as (_client, url):
            status, text = await trio.to_thread.run_sync(
                lambda: http(url + "api/history?minutes=60")
            )
            h = json.loads(text)
            assert status == 200 and len(h["at"]) == 60
            assert (sum(h["finished"]), sum(h["failed"])) == (12, 3)
            status, text = await trio.to_thread.run_sync(
                lambda: http(url + "api/history?minutes=60&queue=q")
            )
            assert sum(json.loads(text)["finished"]) == 12


@pytest.mark.slow
async def test_console_pages_by_number_runs_a_delayed_job_now_and_shows_days(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """Issue 32, item 7: page numbers and a last page; a queue's page opens
    on its first state with jobs; delays of days in days; "run now" of a
    delayed job; a clicked job's details come into view; chart axes with
    labels between 0 and the maximum."""
    async with console(redis_url, namespace) as (client, url):
        await populate(client)
        await client.enqueue_many("emails", [f"bulk:{i:04d}" for i in range(100)])  # 130 queued
        await client.enqueue("late", "renew:contract-7", delay=30 * 86400 + 5 * 3600 + 60)
        with chromium(1280, 900) as driver:
            await in_page(driver, lambda d: d.get(url))
            await page_until(driver, "document.querySelectorAll('#queues tbody tr').length === 4")
            # the next delayed jobs say "30d05h", not "725h01m"
            late = await page_until(
                driver,
                "Array.from(document.querySelectorAll('#delayed tbody tr'))"
                ".map(r => r.innerText).find(t => t.includes('renew:contract-7'))",
            )
            assert "30d05h" in late, late
            # chart axes: 0, the maximum, and round steps between
            ticks = await page_until(
                driver,
                "(t => t.length > 2 && t)(Array.from("
                "document.querySelectorAll('#chart-finished text.tick')).map(e => +e.textContent))",
            )
            assert ticks[0] == 0 and ticks == sorted(ticks) and len(ticks) >= 3, ticks
            assert ticks[-1] >= 40 and all(0 < t < ticks[-1] for t in ticks[1:-1]), ticks
            await screenshot(driver, shots_dir(tmp_path) / "console-days-axes.png")
            await in_page(driver, lambda d: d.set_window_size(1280, 900))
            # a queue with only a delayed job opens on its delayed jobs
            await in_page(driver, lambda d: d.execute_script(
                "Array.from(document.querySelectorAll('#queues a.queue-link'))"
                ".find(a => a.textContent === 'late').click()"
            ))  # fmt: skip
            await page_until(
                driver, "document.querySelector('#q-tabs button.on')?.dataset.state === 'delayed'"
            )
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 1")
            # run now: confirmed, the job is due now
            await in_page(driver, lambda d: d.execute_script(
                "window.confirm = () => true;"
                "document.querySelector('#jobs tbody button.job-run').click()"
            ))  # fmt: skip
            await page_until(
                driver, "document.getElementById('message').textContent.includes('due now')"
            )
            j = await client.job("late", "renew:contract-7")
            assert j is not None and j.due is not None and j.due <= await client.time() + 1
            # page numbers and a last page: 130 queued jobs, 25 a page
            await in_page(driver, lambda d: d.get(url + "#/queue/emails"))
            await page_until(
                driver, "document.getElementById('page-note').textContent === 'page 1 of 6'"
            )
            labels = await in_page(driver, lambda d: d.execute_script(
                "return Array.from(document.querySelectorAll('#page-numbers button'))"
                ".map(b => b.textContent)"
            ))  # fmt: skip
            assert labels == ["1", "2", "3", "6"], labels
            await in_page(driver, lambda d: d.find_element("id", "page-last").click())
            await page_until(
                driver,
                "document.getElementById('page-note').textContent === 'page 6 of 6 (last)'",
            )
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 5")
            await in_page(driver, lambda d: d.execute_script(
                "document.querySelector('#page-numbers button[data-page=\"4\"]').click()"
            ))  # fmt: skip
            await page_until(
                driver, "document.getElementById('page-note').textContent === 'page 4 of 6'"
            )
            first = await page_until(
                driver, "document.querySelector('#jobs tbody tr')?.dataset.task"
            )
            assert first == "bulk:0045", first  # 30 newsletters, then the bulk jobs
            # a clicked job's details come into view (they are below the fold)
            await in_page(driver, lambda d: d.execute_script("window.scrollTo(0, 0)"))
            assert await in_page(driver, lambda d: d.execute_script(
                "return document.querySelector('#jobs tfoot, .pager').getBoundingClientRect().top"
                " > window.innerHeight"
            ))  # fmt: skip
            await in_page(driver, lambda d: d.execute_script(open_job("bulk:0067")))
            await page_until(driver, "document.getElementById('job-actions')")
            await page_until(driver, "document.getElementById('job-actions')")
            top = await page_until(
                driver,
                "(r => r.top >= -1 && r.top < window.innerHeight - 150 && r.top + 1)"
                "(document.getElementById('job-detail').getBoundingClientRect())",
            )
            assert top, top
            await no_overflow(driver, "queue page with numbered pages")
            await screenshot(driver, shots_dir(tmp_path) / "console-pages-job.png")


@pytest.mark.slow
async def test_worker_page_shows_its_lease_queues_and_what_it_holds(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    async with console(redis_url, namespace) as (client, url):
        await populate(client)
        with chromium(1280, 900) as driver:
            await in_page(driver, lambda d: d.get(url))
            await page_until(driver, "document.querySelector('#workers a.worker-link')")
            await in_page(
                driver, lambda d: d.execute_script(
                    "document.querySelector('#workers a.worker-link').click()"
                )
            )  # fmt: skip
            await page_until(driver, "document.querySelectorAll('#w-jobs tbody tr').length === 5")
            assert await in_page(driver, lambda d: d.find_element("id", "overview").get_attribute(
                "hidden"
            )) is not None  # fmt: skip
            lease = await page_until(driver, "document.getElementById('w-lease')?.innerText")
            assert lease.endswith(" left") and lease.startswith("9m"), lease
            queues = await in_page(driver, lambda d: d.find_element("id", "w-queues").text)
            assert queues == "devices, emails"
            rows = await in_page(driver, lambda d: d.find_element("id", "w-jobs").text)
            for task in ("sensor-berlin-01", "sensor-oslo-03", "welcome:user-0001@example.com"):
                assert task in rows
            assert rows.count("persistent") == 3 and rows.count("one-shot") == 2
            await no_overflow(driver, "worker page")
            await screenshot(driver, shots_dir(tmp_path) / "console-worker.png")
            # its queue links lead to the queue's page
            await in_page(driver, lambda d: d.execute_script(
                "document.querySelector('#w-queues a').click()"
            ))  # fmt: skip
            await page_until(driver, "document.getElementById('q-name').textContent === 'devices'")
            await page_until(driver, "document.getElementById('worker-view').hidden")


@pytest.mark.slow
async def test_job_details_show_the_attempt_history_and_the_whole_error(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """A job that failed three times: its details list each attempt (when,
    worker, error, newest first) and keep the error's lines; its payload of
    3 MiB is shown by its first bytes with a link that downloads it whole."""
    async with console(redis_url, namespace) as (client, url):
        conn, b = client._conn, Binding(client._keys)
        await b.register(conn, "w-7", "i", 600_000, b"{}")
        await b.serve(conn, "w-7", "i", "jobs")
        payload = b"report:" + b"r" * (3 << 20)
        await client.enqueue("jobs", payload)
        for i in range(3):
            c = await b.claim(conn, "w-7", "i", "jobs", 1, 3)
            trace = (
                "Traceback (most recent call last):\n"
                f'  File "app.py", line {10 + i}, in handle\n'
                "    render(report)\n"
                f"ValueError: attempt {i + 1} failed"
            )
            await b.give_back(conn, "w-7", "jobs", [c.processes[0].id], failed=True, errors=[trace])
        with chromium(1280, 900) as driver:
            await in_page(driver, lambda d: d.get(url))
            await page_until(driver, "document.querySelector('#queues a.queue-link')")
            await in_page(driver, lambda d: d.get(url + "#/queue/jobs"))
            await page_until(
                driver, "document.querySelector('#q-tabs button.on')?.dataset.state === 'dead'"
            )
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 1")
            size = await in_page(driver, lambda d: d.find_element("id", "jobs").text)
            assert "3.0 MiB" in size
            await in_page(driver, lambda d: d.execute_script(
                "document.querySelector('#jobs tbody a').click()"
            ))  # fmt: skip
            await page_until(driver, "document.querySelectorAll('#job-tries tbody tr').length")
            rows = await in_page(driver, lambda d: d.execute_script(
                "return Array.from(document.querySelectorAll('#job-tries tbody tr'))"
                ".map(r => r.innerText)"
            ))  # fmt: skip
            assert len(rows) == 3, rows
            assert "attempt 3 failed" in rows[0] and "attempt 1 failed" in rows[2]
            assert all("w-7" in r and "line 1" in r for r in rows)
            err = await in_page(driver, lambda d: d.find_element("id", "job-error").text)
            assert err.splitlines()[0] == "Traceback (most recent call last):", err
            link = await in_page(
                driver, lambda d: d.find_element("id", "job-download").get_attribute("href")
            )
            assert "ref=dead." in link and len(link) < 200
            status, body = await trio.to_thread.run_sync(http, link)
            assert status == 200 and len(body) == len(payload)
            shown = await in_page(driver, lambda d: d.find_element("id", "job-body").text)
            assert "report:rrr" in shown and len(shown) < 20_000
            await no_overflow(driver, "job details with attempts")
            await screenshot(driver, shots_dir(tmp_path) / "console-attempts.png")


@pytest.mark.slow
async def test_completed_jobs_show_with_their_results_where_kept(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    from mesh._replies import ResultsToKeep

    async with console(redis_url, namespace) as (client, url):
        conn, b = client._conn, Binding(client._keys)
        await b.register(conn, "w-r", "i", 600_000, b"{}")
        await b.serve(conn, "w-r", "i", "renders")
        await client.enqueue_many("renders", ["page-1", "page-2", "page-3"])
        c = await b.claim(conn, "w-r", "i", "renders", 3, 1)
        values = {
            c.processes[0].id: (b"page-1", b'{"pixels": 1024}'),
            c.processes[1].id: (b"page-2", None),
            c.processes[2].id: (b"page-3", b"r" * 5000),
        }
        await b.finish(conn, "w-r", "i", "renders", list(values), ResultsToKeep(600_000, values))
        await client.enqueue("renders", "still-queued")
        with chromium(1280, 900) as driver:
            await in_page(driver, lambda d: d.get(url + "#/queue/renders"))
            await page_until(driver, "document.querySelectorAll('#q-tabs button').length === 5")
            await in_page(driver, lambda d: d.execute_script(
                "document.querySelector('#q-tabs button[data-state=completed]').click()"
            ))  # fmt: skip
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 3")
            rows = await in_page(driver, lambda d: d.execute_script(
                "return Object.fromEntries(Array.from(document.querySelectorAll('#jobs tbody tr'))"
                ".map(r => [r.dataset.task, r.innerText]))"
            ))  # fmt: skip
            assert '{"pixels": 1024}' in rows["page-1"] and "w-r" in rows["page-1"]
            assert "(returned nothing)" in rows["page-2"]
            assert "4.9 KiB" in rows["page-3"]
            form = await in_page(driver, lambda d: d.find_element("id", "search-form"))
            assert await in_page(driver, lambda d: form.get_attribute("hidden")) is not None
            await no_overflow(driver, "completed jobs")
            await screenshot(driver, shots_dir(tmp_path) / "console-completed.png")
        # a queue that keeps no results says how to keep them
        status, text = await trio.to_thread.run_sync(http, url + "api/completed?queue=other")
        assert status == 200 and json.loads(text) == {"queue": "other", "next": None, "jobs": []}


@pytest.mark.slow
async def test_a_page_of_big_payloads_is_not_read_again_on_its_own(
    redis_url: str, namespace: str
) -> None:
    """Two jobs of 40 MiB: the queue page shows their first bytes and sizes
    and says it is not refreshed every 5 s (each read copies every payload
    of the page inside Redis); clicking the tab reads it again."""
    async with console(redis_url, namespace) as (client, url):
        await client.enqueue_many("blobs", [b"blob-%d:" % i + b"b" * (40 << 20) for i in range(2)])
        with chromium(1280, 900) as driver:
            await in_page(driver, lambda d: d.get(url))
            await page_until(driver, "document.querySelector('#queues a.queue-link')")
            await in_page(driver, lambda d: d.execute_script(
                "window.__reads = 0; const f = window.fetch;"
                "window.fetch = (u, o) => {"
                " if (String(u).startsWith('/api/jobs')) window.__reads++; return f(u, o); };"
                "location.hash = '#/queue/blobs';"
            ))  # fmt: skip
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 2")
            note = await page_until(
                driver,
                "(t => t.includes('not refreshed') && t)"
                "(document.getElementById('page-note').textContent)",
            )
            assert "80.0 MiB of payloads" in note, note
            rows = await in_page(driver, lambda d: d.find_element("id", "jobs").text)
            assert "40.0 MiB" in rows and "blob-0:bbb" in rows
            reads = await in_page(driver, lambda d: d.execute_script("return window.__reads"))
            # nothing happens in this window: the 5 s refresh skips the page
            await trio.sleep(6)
            assert await in_page(
                driver, lambda d: d.execute_script("return window.__reads")
            ) == reads  # fmt: skip
            await in_page(driver, lambda d: d.execute_script(
                "document.querySelector('#q-tabs button[data-state=queued]').click()"
            ))  # fmt: skip
            await page_until(driver, f"window.__reads > {reads}")
