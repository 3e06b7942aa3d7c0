"""The console's groups of a queue, in Debian's headless Chromium and over
HTTP: the queue page lists the top groups by backlog (queued, running
against the cap, delayed, weight, rate, paused) and how many there are,
pauses and resumes one group; the actions keep the console's rules (the
``X-Mesh-Action`` header, the token) and bad input is a 400 naming it.

``MESH_CONSOLE_SCREENSHOTS=DIR`` keeps the screenshot (docs/img/ holds the
docs' one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

import mesh

from .browser import chromium, http, in_page, page_until
from .test_dashboard_console import console, no_overflow, screenshot, shots_dir


async def populate_groups(client: mesh.Client) -> None:
    """A queue of 30 tenants (tenant-07 with the biggest backlog, one capped,
    one rate limited, one paused, one with delayed jobs) and ungrouped jobs."""
    for i in range(30):
        n = 40 if i == 7 else 30 - i
        await client.enqueue_many(
            "emails", [f"t{i}-{k}" for k in range(n)], group=f"tenant-{i:02d}"
        )
    await client.enqueue_many("emails", ["plain-1", "plain-2"])
    await client.enqueue("emails", "later", group="tenant-03", delay=600)
    await client.configure("emails", group_concurrency=4)
    await client.configure_group("emails", "tenant-07", concurrency=2, weight=3)
    await client.configure_group("emails", "tenant-01", rate_limit=(10, 60.0))
    await client.pause_group("emails", "tenant-02")


@pytest.mark.slow
async def test_queue_page_lists_the_top_groups_and_pauses_one(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    async with console(redis_url, namespace) as (client, url):
        await populate_groups(client)
        with chromium(1400, 1000) as driver:
            await in_page(driver, lambda d: d.get(url + "#/queue/emails"))
            await page_until(
                driver, "document.querySelectorAll('#q-groups tbody tr').length === 20"
            )
            count = await in_page(driver, lambda d: d.find_element("id", "groups-count").text)
            assert count.startswith("(30 groups, the 20 with the most queued shown: ")
            rows = await in_page(driver, lambda d: d.execute_script(
                "return Array.from(document.querySelectorAll('#q-groups tbody tr'))"
                ".map(r => Array.from(r.cells).map(c => c.textContent))"
            ))  # fmt: skip
            assert rows[0][:6] == ["tenant-07", "40", "0 / 2", "0", "3", "-"]
            by_name = {r[0]: r for r in rows}
            assert by_name["tenant-01"][5] == "10 per 60s"
            assert by_name["tenant-02"][6] == "paused" and by_name["tenant-02"][7] == "Resume"
            assert by_name["tenant-03"][2:4] == ["0 / 4", "1"]
            default = await in_page(driver, lambda d: d.find_element("id", "groups-default").text)
            assert default == "default for every group: concurrency 4, rate limit -, weight -"
            await no_overflow(driver, "groups")
            # the queue's counts include its groups' jobs
            head = await in_page(driver, lambda d: d.find_element("id", "q-counts").text)
            assert head.startswith(
                f"({40 + sum(30 - i for i in range(30) if i != 7) + 2} queued, 1 delayed"
            )
            await screenshot(driver, shots_dir(tmp_path) / "dashboard-groups.png")
            # pause tenant-07 from its row, then resume it
            click = (
                "window.confirm = () => true;"
                "Array.from(document.querySelectorAll('#q-groups tbody tr'))"
                ".find(r => r.cells[0].textContent === 'tenant-07').querySelector('button').click()"
            )
            await in_page(driver, lambda d: d.execute_script(click))
            await page_until(driver, "document.getElementById('message').textContent"
                             ".startsWith('paused group \"tenant-07\"')")  # fmt: skip
            look = await client.groups("emails", limit=1)
            assert look.groups[0].name == "tenant-07" and look.groups[0].paused is not None
            await page_until(
                driver,
                "Array.from(document.querySelectorAll('#q-groups tbody tr'))"
                ".find(r => r.cells[0].textContent === 'tenant-07')"
                ".cells[7].textContent === 'Resume'",
            )
            await in_page(driver, lambda d: d.execute_script(click))
            await page_until(driver, "document.getElementById('message').textContent"
                             ".startsWith('resumed group')")  # fmt: skip
            assert (await client.groups("emails", limit=1)).groups[0].paused is None


async def test_a_queue_without_groups_hides_the_section(redis_url: str, namespace: str) -> None:
    async with console(redis_url, namespace) as (client, url):
        await client.enqueue("plain", "x")
        status, text = await trio.to_thread.run_sync(http, url + "api/groups?queue=plain")
        assert status == 200
        assert json.loads(text)["total"] == 0 and json.loads(text)["groups"] == []
        with chromium(1280, 800) as driver:
            await in_page(driver, lambda d: d.get(url + "#/queue/plain"))
            await page_until(driver, "document.querySelectorAll('#jobs tbody tr').length === 1")
            await page_until(driver, "document.getElementById('groups-count').textContent === ''"
                             " || document.getElementById('q-groups-section').hidden")  # fmt: skip
            assert await in_page(
                driver,
                lambda d: d.execute_script(
                    "return document.getElementById('q-groups-section').hidden"
                ),
            )


async def test_group_actions_need_the_action_header_and_the_token(
    redis_url: str, namespace: str
) -> None:
    async with console(redis_url, namespace, token="t0ken") as (client, url):
        await client.enqueue("q", "x", group="g1")
        body = json.dumps({"queue": "q", "group": "g1"}).encode()
        auth = {"Authorization": "Bearer t0ken", "Content-Type": "application/json"}
        for path in ("api/group/pause", "api/group/resume"):
            status, _ = await trio.to_thread.run_sync(
                http, url + path, body, {"Content-Type": "application/json"}
            )
            assert status == 401
            status, _ = await trio.to_thread.run_sync(http, url + path, body, auth)
            assert status == 403
        assert (await client.groups("q")).groups[0].paused is None
        act = {**auth, "X-Mesh-Action": "1"}
        status, text = await trio.to_thread.run_sync(http, url + "api/group/pause", body, act)
        assert status == 200 and json.loads(text)["changed"] is True
        assert (await client.groups("q")).groups[0].paused is not None
        for bad, says in (
            ({"queue": "q"}, "missing 'group'"),
            ({"queue": "q", "group": "a b"}, "invalid group name"),
            ({"queue": "q", "group": 3}, "'group' must be a string"),
        ):
            data = json.dumps(bad).encode()
            status, text = await trio.to_thread.run_sync(http, url + "api/group/resume", data, act)
            assert status == 400 and says in json.loads(text)["error"], text
        assert (await client.groups("q")).groups[0].paused is not None
        status, text = await trio.to_thread.run_sync(
            lambda: http(url + "api/groups?queue=q&limit=0", headers=auth)
        )
        assert status == 400 and "limit must be 1 to 1000" in json.loads(text)["error"]
        status, text = await trio.to_thread.run_sync(
            lambda: http(url + "api/groups?queue=q", headers=auth)
        )
        got = json.loads(text)
        assert status == 200 and got["total"] == 1 and got["groups"][0]["name"] == "g1"


def rows_js(col: int = 0) -> str:
    """JavaScript: the text of column ``col`` of every row of the Jobs table."""
    return (
        "Array.from(document.querySelectorAll('#jobs tbody tr'))"
        f".map(r => r.cells[{col}].textContent)"
    )


def text_of(id_: str) -> str:
    return f"document.getElementById({json.dumps(id_)}).textContent"


@pytest.mark.slow
async def test_a_groups_name_lists_its_jobs_paged_with_a_filter_to_clear(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    async with console(redis_url, namespace) as (client, url):
        await populate_groups(client)
        grouped = 40 + sum(30 - i for i in range(30) if i != 7)
        with chromium(1400, 1000) as driver:
            await in_page(driver, lambda d: d.get(url + "#/queue/emails"))
            await page_until(driver, text_of("jobs-count") + " === '(queued: 2)'")
            # the queued tab says where the rest of its count is
            note = await page_until(
                driver, f"!document.getElementById('group-note').hidden && {text_of('group-note')}"
            )
            assert note == (
                f"{grouped} more queued jobs are in groups, not in this list: "
                "click a group's name under Groups to list its jobs."
            )
            assert await in_page(driver, lambda d: d.execute_script("return " + rows_js())) == [
                "plain-1",
                "plain-2",
            ]
            # tenant-07's name opens its jobs: 40 queued, 25 a page, a filter
            await in_page(driver, lambda d: d.execute_script(
                "Array.from(document.querySelectorAll('#q-groups a.group-link'))"
                ".find(a => a.textContent === 'tenant-07').click()"
            ))  # fmt: skip
            await page_until(
                driver, text_of("jobs-count") + " === '(queued in group tenant-07: 40)'"
            )
            assert (await in_page(driver, lambda d: d.current_url)).endswith(
                "#/queue/emails/group/tenant-07"
            )
            first = await in_page(driver, lambda d: d.execute_script("return " + rows_js()))
            assert first == [f"t7-{k}" for k in range(25)]
            shown = await in_page(driver, lambda d: d.execute_script(
                "return [document.getElementById('group-filter').hidden,"
                f" {text_of('group-filter-name')}, document.getElementById('group-note').hidden,"
                " document.getElementById('search-form').hidden,"
                " Array.from(document.querySelectorAll('#q-tabs button')).map(b => b.textContent)]"
            ))  # fmt: skip
            tabs_shown = ["queued (40)", "delayed (0)", "running (0)", "dead"]
            assert shown == [False, "tenant-07", True, True, tabs_shown]
            picked = await page_until(
                driver, "document.querySelector('#q-groups tr.selected')?.cells[0].textContent"
            )
            assert picked == "tenant-07"
            await no_overflow(driver, "a group's jobs")
            await screenshot(driver, shots_dir(tmp_path) / "dashboard-group-jobs.png")
            # the last page holds the group's last 15
            await in_page(driver, lambda d: d.find_element("id", "page-last").click())
            await page_until(driver, text_of("page-note") + " === 'page 2 of 2 (last)'")
            rest = await in_page(driver, lambda d: d.execute_script("return " + rows_js()))
            assert rest == [f"t7-{k}" for k in range(25, 40)]
            # delete one of the group's jobs from its row
            await in_page(driver, lambda d: d.execute_script(
                "window.confirm = () => true;"
                "Array.from(document.querySelectorAll('#jobs tbody tr'))"
                ".find(r => r.dataset.task === 't7-39').querySelector('button.job-cancel').click()"
            ))  # fmt: skip
            await page_until(driver, text_of("message") + ".startsWith('cancelled \"t7-39\": 1')")
            page = await client.jobs("emails", "queued", group="tenant-07", limit=100)
            assert page.total == 39 and b"t7-39" not in [j.task for j in page.jobs]
            # the group's delayed jobs, with their priority, under their tab
            await client.enqueue("emails", "t7-later", group="tenant-07", delay=3600, priority=3)
            await in_page(driver, lambda d: d.execute_script(
                "Array.from(document.querySelectorAll('#q-tabs button'))"
                ".find(b => b.dataset.state === 'delayed').click()"
            ))  # fmt: skip
            await page_until(
                driver, text_of("jobs-count") + " === '(delayed in group tenant-07: 1)'"
            )
            rows = await in_page(driver, lambda d: d.execute_script(
                "return Array.from(document.querySelectorAll('#jobs tbody tr'))"
                ".map(r => Array.from(r.cells).map(c => c.textContent))"
            ))  # fmt: skip
            assert [(r[0], r[2], r[4]) for r in rows] == [("t7-later", "one-shot", "3")], rows
            await screenshot(driver, shots_dir(tmp_path) / "dashboard-group-delayed.png")
            # Clear: back to the queue's own list, its note again
            await in_page(driver, lambda d: d.find_element("id", "group-clear").click())
            await page_until(driver, text_of("jobs-count") + " === '(queued: 2)'")
            assert (await in_page(driver, lambda d: d.current_url)).endswith("#/queue/emails")
            await page_until(driver, "!document.getElementById('group-note').hidden")
            tabs = await in_page(driver, lambda d: d.execute_script(
                "return Array.from(document.querySelectorAll('#q-tabs button')).length"
            ))  # fmt: skip
            assert tabs == 5


async def test_a_groups_running_jobs_in_the_page_and_the_api(
    redis_url: str, namespace: str
) -> None:
    from mesh._binding import Binding

    from .protocol_helpers import join

    async with console(redis_url, namespace) as (client, url):
        conn, b = client._conn, Binding(client._keys)
        inc = await join(b, conn, "w1", "q")
        await client.enqueue_many("q", ["s1", "s2", "s3"], group="solo")
        await client.enqueue_many("q", ["o1", "o2"], group="other")
        await client.pause_group("q", "other")
        await b.claim(conn, "w1", inc, "q", 2, 1)

        async def get(path: str) -> tuple[int, str]:
            return await trio.to_thread.run_sync(http, url + path)

        status, text = await get("api/jobs?queue=q&state=running&group=solo")
        got = json.loads(text)
        assert status == 200 and got["group"] == "solo" and got["total"] == 2
        assert [j["task"] for j in got["jobs"]] == ["s1", "s2"]
        assert all(j["worker"] == "w1" and j["group"] == "solo" for j in got["jobs"])
        status, text = await get("api/jobs?queue=q&state=queued&group=solo&limit=1")
        got = json.loads(text)
        assert status == 200 and got["total"] == 1 and got["jobs"][0]["task"] == "s3"
        assert got["jobs"][0]["task_b64"] == "czM=" and got["jobs"][0]["ref"] is None
        status, text = await get("api/jobs?queue=q&group=other&limit=1&after=c1")
        got = json.loads(text)
        assert status == 200 and [j["task"] for j in got["jobs"]] == ["o2"] and got["next"] is None
        status, text = await get("api/jobs?queue=q&state=dead&group=solo")
        got = json.loads(text)
        assert status == 200 and got["total"] == 0 and got["jobs"] == []
        for query, says in (
            ("group=a%20b", "invalid group name 'a b'"),
            ("group=", "invalid group name ''"),
            ("group=solo&prefix=s", "without a prefix"),
        ):
            status, text = await get("api/jobs?queue=q&" + query)
            err = json.loads(text)["error"]
            assert status == 400 and says in err and "\n" not in err, text
        with chromium(1280, 900) as driver:
            await in_page(driver, lambda d: d.get(url + "#/queue/q/group/solo"))
            await page_until(driver, text_of("jobs-count") + " === '(queued in group solo: 1)'")
            await in_page(driver, lambda d: d.execute_script(
                "Array.from(document.querySelectorAll('#q-tabs button'))"
                ".find(b => b.dataset.state === 'running').click()"
            ))  # fmt: skip
            await page_until(driver, text_of("jobs-count") + " === '(running in group solo: 2)'")
            cells = await in_page(driver, lambda d: d.execute_script(
                "return Array.from(document.querySelectorAll('#jobs tbody tr'))"
                ".map(r => [r.cells[0].textContent, r.cells[3].textContent])"
            ))  # fmt: skip
            assert cells == [["s1", "w1"], ["s2", "w1"]]
