"""The dashboard in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by selenium): it shows a worker the test starts,
follows its death and the takeover of its task live, and a cancel from the
page stops the task. Also its HTTP rules: the token, the action header, and
no credentials on the page."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

import mesh
from mesh._view import share_text
from mesh.dashboard import serve_dashboard
from mesh.testing import wait_until

from .browser import chromium, http, in_page, page_until
from .cli_helpers import clean_env, mesh_cli, running_process, stderr_until

APP = """
import trio

async def hold(process):
    await trio.sleep_forever()

queues = {"devices": hold}
"""


def row_text(table: str, attr: str, key: str) -> str:
    """JavaScript: the text of the row of ``table`` whose ``data-attr`` is ``key``."""
    return (
        f"(Array.from(document.querySelectorAll('#{table} tbody tr'))"
        f".find(r => r.dataset.{attr} === {json.dumps(key)}) || {{}}).innerText"
    )


@asynccontextmanager
async def dashboard(url: str, namespace: str, **kw: Any) -> AsyncIterator[tuple[mesh.Client, str]]:
    async with mesh.open_client(url, namespace=namespace) as client:
        async with serve_dashboard(client, interval=0.1, **kw) as page:
            yield client, page


@pytest.mark.slow
async def test_page_follows_a_worker_live_and_cancels_a_task(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    (tmp_path / "dash_app.py").write_text(APP)
    cancelled = trio.Event()
    async with running_process(
        [
            *(sys.executable, "-m", "mesh.cli", "worker", "dash_app:queues", "--ttl", "1"),
            *("--worker-id", "w-doomed", "--redis", redis_url, "--namespace", namespace),
        ],
        cwd=tmp_path,
        stderr=subprocess.DEVNULL,
        env=clean_env(),
    ) as proc:
        async with (
            dashboard(
                redis_url,
                namespace,
                header={"redis": mesh.parse_url(redis_url).redacted(), "namespace": namespace},
            ) as (client, url),
            trio.open_nursery() as nursery,
        ):
            await client.ensure("devices", "sensor-7")
            await client.enqueue_many("reports", ["r1", "r2", "r3"])  # nobody serves it
            await client.ensure("spares", "lonely")  # nobody serves it either
            with chromium() as driver:
                await in_page(driver, lambda d: d.get(url))
                # the worker the test started, alive, owning the task
                row = await page_until(
                    driver, row_text("workers", "worker", "w-doomed"), what="the worker"
                )
                await page_until(
                    driver,
                    row_text("persistent", "task", "sensor-7") + "?.includes('w-doomed')",
                    what="the task owned by w-doomed",
                )
                assert "alive" in row and "devices" in row
                # an unowned task says so, and for how long (Redis keeps since when)
                lonely = await page_until(
                    driver, row_text("persistent", "task", "lonely"), what="the unowned task"
                )
                assert "unowned" in lonely
                assert re.search(r"\b\d+(\.\d)?m?s\b", lonely), lonely  # not "-"
                title = await in_page(driver, lambda d: d.title)
                assert title == "trio-mesh dashboard"

                # a peer in this process, to take the task over
                async def peer() -> None:
                    async def hold(p: mesh.Process) -> None:
                        try:
                            await trio.sleep_forever()
                        finally:
                            cancelled.set()

                    async with mesh.open_worker(
                        redis_url, namespace=namespace, ttl=1, worker_id="w-peer"
                    ) as w:
                        await w.start_work("devices", hold)
                        await trio.sleep_forever()

                nursery.start_soon(peer)
                await page_until(driver, row_text("workers", "worker", "w-peer"), what="w-peer")
                proc.kill()  # no hand-back: its lease runs out, a peer recycles it
                await page_until(
                    driver,
                    row_text("persistent", "task", "sensor-7") + "?.includes('w-peer')",
                    what="the task taken over by w-peer",
                )
                takeover = await page_until(
                    driver,
                    "document.querySelector('#takeovers tbody tr')?.innerText.includes('w-doomed')"
                    " && document.querySelector('#takeovers tbody tr').innerText",
                    what="the takeover",
                )
                assert "recycled" in takeover and "w-peer" in takeover
                await page_until(
                    driver,
                    "!" + row_text("workers", "worker", "w-doomed"),
                    what="the dead worker gone",
                )
                shot = os.environ.get("MESH_DASHBOARD_SCREENSHOT") or str(tmp_path / "d.png")
                await in_page(driver, lambda d: d.save_screenshot(shot))
                assert (await trio.Path(shot).stat()).st_size > 10_000

                # cancel from the page: the button, then the confirmation
                def click_cancel(d: Any) -> None:
                    from selenium.common.exceptions import StaleElementReferenceException
                    from selenium.webdriver.common.by import By

                    # The page's confirmation, answered "yes" and recorded.
                    d.execute_script(
                        "window.__asked = [];"
                        "window.confirm = q => { window.__asked.push(q); return true; };"
                    )
                    for _ in range(50):  # the table is redrawn at every update
                        try:
                            rows = d.find_elements(By.CSS_SELECTOR, "#persistent tbody tr")
                            [r] = [r for r in rows if r.get_attribute("data-task") == "sensor-7"]
                            button = r.find_element(By.CSS_SELECTOR, "button.cancel")
                            # a click on the element itself: a click at its
                            # place on the screen missed it when a live redraw
                            # moved the layout in between
                            d.execute_script("arguments[0].click()", button)
                        except StaleElementReferenceException:
                            continue
                        if d.execute_script("return window.__asked.length"):
                            break
                    asked = d.execute_script("return window.__asked")
                    assert len(asked) == 1 and "sensor-7" in asked[0], asked

                await in_page(driver, click_cancel)
                with trio.fail_after(10):
                    await cancelled.wait()  # the handler was stopped
                await page_until(
                    driver, "!" + row_text("persistent", "task", "sensor-7"), what="no task"
                )
                assert await client.persistent_tasks("devices") == {}
            nursery.cancel_scope.cancel()


async def test_page_shows_each_share_by_weight_against_capacity(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """One task of weight 3 and three of weight 1 (a total weight of 6) over a
    worker of capacity 2 and one of capacity 1: fair shares of 4 and 2 by
    weight (not 4 tasks / 2 workers = 2 each); the page shows what
    Client.workers() (``mesh status``) reports, once nothing is moving."""

    async def hold(p: mesh.Process) -> None:
        await trio.sleep_forever()

    async with (
        dashboard(redis_url, namespace) as (client, url),
        # a long lease: under a loaded machine a short one fenced both workers
        # (they rejoined under new ids)
        mesh.open_worker(redis_url, namespace=namespace, ttl=10, worker_id="w-big") as big,
        mesh.open_worker(redis_url, namespace=namespace, ttl=10, worker_id="w-small") as small,
    ):
        await big.start_work("devices", hold, capacity=2)
        await small.start_work("devices", hold)
        await client.ensure("devices", "heavy", weight=3)
        await client.ensure_many("devices", ["l1", "l2", "l3"])
        with chromium() as driver:
            await in_page(driver, lambda d: d.get(url))

            async def page_agrees() -> dict[str, str] | None:
                infos = await client.workers()
                weights = [sh.weight for w in infos for sh in w.shares]
                moving = [sh.incoming + sh.outgoing for w in infos for sh in w.shares]
                if sum(weights) != 6 or any(moving):
                    return None  # not all owned yet, or a rebalance under way
                want = {w.id: share_text(w.shares) for w in infos}
                for wid, text in want.items():
                    script = "return " + row_text("workers", "worker", wid)

                    def read_row(d: Any, script: str = script) -> Any:
                        return d.execute_script(script)

                    row = await in_page(driver, read_row)
                    if not row or text not in row:
                        return None
                return want

            want = await wait_until(
                page_agrees, within=30, every=0.1, what="the page to show Client.workers' shares"
            )
            # by the workers' current ids (a worker that fenced itself rejoins
            # under a new one)
            assert re.fullmatch(r"devices [1-6]/4 x2", want.get(big.id, "")), want
            assert re.fullmatch(r"devices [1-6]/2", want.get(small.id, "")), want
            shot = os.environ.get("MESH_DASHBOARD_SHARES_SCREENSHOT") or str(tmp_path / "s.png")
            await in_page(driver, lambda d: d.save_screenshot(shot))
            assert (await trio.Path(shot).stat()).st_size > 10_000


async def test_token_and_action_header_are_required(redis_url: str, namespace: str) -> None:
    async with dashboard(redis_url, namespace, token="s3cret") as (client, url):
        assert url.startswith("http://127.0.0.1:")  # loopback by default
        status, _ = await trio.to_thread.run_sync(http, url)
        assert status == 401
        status, body = await trio.to_thread.run_sync(
            lambda: http(url + "state", headers={"Authorization": "Bearer s3cret"})
        )
        assert status == 200 and json.loads(body)["namespace"] == namespace
        await client.ensure("q", "x")
        cancel = json.dumps({"queue": "q", "task": "x"}).encode()
        auth = {"Authorization": "Bearer s3cret", "Content-Type": "application/json"}
        status, _ = await trio.to_thread.run_sync(
            lambda: http(url + "api/cancel", data=cancel, headers=auth)
        )
        assert status == 403  # no X-Mesh-Action: a cross-site form cannot cancel
        assert await client.persistent_tasks("q") == {b"x": None}
        status, body = await trio.to_thread.run_sync(
            lambda: http(url + "api/cancel", data=cancel, headers={**auth, "X-Mesh-Action": "1"})
        )
        assert status == 200 and json.loads(body) == {"cancelled": 1}
        assert await client.persistent_tasks("q") == {}


async def test_the_page_never_shows_the_password(own_redis: Any) -> None:
    password = "pw-dash-7f3e"
    async with (
        mesh.open_client(own_redis.url) as admin,
    ):
        await admin._conn.execute("CONFIG", "SET", "requirepass", password)
    url = own_redis.url.replace("redis://", f"redis://:{password}@")
    shown = mesh.parse_url(url).redacted()
    async with dashboard(url, "ns", header={"redis": shown, "namespace": "ns"}) as (_, page):
        status, body = await trio.to_thread.run_sync(http, page + "state")
        assert status == 200
        assert password not in body and "***" in json.loads(body)["redis"]
        status, html = await trio.to_thread.run_sync(http, page)
        assert password not in html


async def test_mesh_dashboard_refuses_other_addresses_without_a_token() -> None:
    r = await mesh_cli("dashboard", "--host", "0.0.0.0")
    assert r.returncode == 2, r.stderr
    assert b"--token" in r.stderr and b"Traceback" not in r.stderr
    r = await mesh_cli("dashboard", "--token", "")
    assert r.returncode == 2 and b"empty" in r.stderr


@pytest.mark.slow
async def test_mesh_dashboard_command_serves_and_stops(redis_url: str, namespace: str) -> None:
    async with running_process(
        [
            *(sys.executable, "-m", "mesh.cli", "dashboard", "--port", "0"),
            *("--redis", redis_url, "--namespace", namespace),
        ],
        stderr=subprocess.PIPE,
        env=clean_env(),
    ) as proc:
        log = await stderr_until(proc, rb"http://\S+/")
        m = re.search(rb"http://127\.0\.0\.1:\d+/", log)
        assert m is not None, log  # loopback by default
        status, body = await trio.to_thread.run_sync(http, m.group().decode() + "state")
        assert status == 200 and json.loads(body)["namespace"] == namespace
        proc.terminate()
        with trio.fail_after(10):
            assert await proc.wait() == 0


async def test_a_port_in_use_is_a_config_error(redis_url: str, namespace: str) -> None:
    async with dashboard(redis_url, namespace) as (client, url):
        port = int(url.rsplit(":", 1)[1].strip("/"))
        with pytest.raises(mesh.ConfigError, match="cannot serve the dashboard"):
            async with serve_dashboard(client, port=port):
                pass  # pragma: no cover


async def test_dead_letters_are_requeued_from_the_page_and_purged(
    redis_url: str, namespace: str
) -> None:
    async def fail(p: mesh.Process) -> None:
        raise RuntimeError("boom")

    async with dashboard(redis_url, namespace) as (client, url):
        async with mesh.open_worker(redis_url, namespace=namespace, ttl=1) as w:
            await w.start_work("jobs", fail, max_attempts=1)
            await client.enqueue_many("jobs", ["a", "b"])

            async def two_dead() -> bool:
                return len(await client.dead_letters("jobs")) >= 2

            await wait_until(two_dead, within=10, what="two dead letters")
        with chromium() as driver:
            await in_page(driver, lambda d: d.get(url))
            row = await page_until(driver, row_text("queues", "queue", "jobs"), what="jobs")
            assert "requeue" in row and "purge" in row

            def click_requeue(d: Any) -> None:
                from selenium.common.exceptions import (
                    StaleElementReferenceException,
                    TimeoutException,
                )
                from selenium.webdriver.common.by import By
                from selenium.webdriver.support import expected_conditions
                from selenium.webdriver.support.ui import WebDriverWait

                # The table is redrawn at every update: a click can find a
                # button that is replaced under it (stale), or land on one
                # just removed (no confirm dialog): click again until the
                # dialog shows.
                for _ in range(50):
                    try:
                        d.find_element(By.CSS_SELECTOR, "#queues button.dead-requeue").click()
                    except StaleElementReferenceException:
                        continue
                    try:
                        alert = WebDriverWait(d, 2).until(expected_conditions.alert_is_present())
                    except TimeoutException:
                        continue
                    break
                assert "jobs" in alert.text
                alert.accept()

            await in_page(driver, click_requeue)
            await page_until(
                driver,
                row_text("queues", "queue", "jobs") + "?.includes('requeue') === false",
                what="no dead letters left",
            )
        assert await client.dead_letters("jobs") == []
        assert sorted(await client.tasks("jobs")) == [b"a", b"b"]
        # purge, over HTTP (the page's other button sends the same request)
        await client.enqueue("x", "y")
        async with mesh.open_worker(redis_url, namespace=namespace, ttl=1) as w:
            await w.start_work("x", fail, max_attempts=1)
            await wait_until(lambda: client.dead_letters("x"), within=10, what="x dead")
        headers = {"Content-Type": "application/json", "X-Mesh-Action": "1"}
        body = json.dumps({"queue": "x"}).encode()
        status, text = await trio.to_thread.run_sync(
            lambda: http(url + "api/dead/purge", data=body, headers=headers)
        )
        assert status == 200 and json.loads(text) == {"purged": 1}
        assert await client.dead_letters("x") == []
        status, _ = await trio.to_thread.run_sync(
            lambda: http(url + "api/dead/drop-table", data=body, headers=headers)
        )
        assert status == 404


async def test_a_foreign_host_header_is_refused_dns_rebinding(
    redis_url: str, namespace: str
) -> None:
    """A page on evil.example rebound to 127.0.0.1 sends ``Host:
    evil.example``: the page, the state and the actions refuse it (421) and
    nothing changes; the bound address, loopback names and allowed names
    pass."""
    async with dashboard(redis_url, namespace, allow_hosts=["mesh.internal"]) as (client, url):
        await client.enqueue("q", "job")
        port = url.rsplit(":", 1)[1].strip("/")
        evil = {"Host": "evil.example"}
        for path in ("", "state", "api/jobs?queue=q", "api/payload?queue=q&ref=x"):
            status, body = await trio.to_thread.run_sync(partial(http, url + path, None, evil))
            assert status == 421, (path, status)
            assert "evil.example" in body and "--allow-host" in body
        act = {**evil, "X-Mesh-Action": "1", "Content-Type": "application/json"}
        for path, data in (
            ("api/pause", {"queue": "q"}),
            ("api/cancel", {"queue": "q", "task": "job"}),
            ("api/dead/purge", {"queue": "q"}),
        ):
            status, _ = await trio.to_thread.run_sync(
                partial(http, url + path, data=json.dumps(data).encode(), headers=act)
            )
            assert status == 421, path
        assert not (await client.queue_info("q")).paused
        assert (await client.jobs("q")).total == 1
        # a rebound name with our port, and an IP literal not ours, also fail
        for host in (f"evil.example:{port}", "10.0.0.8", f"[::2]:{port}", ""):
            status, _ = await trio.to_thread.run_sync(
                partial(http, url + "state", headers={"Host": host})
            )
            assert status == 421, host
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "mesh.internal", "[::1]"):
            status, _ = await trio.to_thread.run_sync(
                partial(http, url + "state", headers={"Host": host})
            )
            assert status == 200, host
        status, _ = await trio.to_thread.run_sync(
            partial(
                http,
                url + "api/pause",
                data=b'{"queue": "q"}',
                headers={**act, "Host": f"localhost:{port}"},
            )
        )
        assert status == 200 and (await client.queue_info("q")).paused


async def test_allowed_hosts_must_be_names(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        with pytest.raises(mesh.ConfigError, match="host name or an address without a port"):
            async with serve_dashboard(client, allow_hosts=["evil.example:80"]):
                pass  # pragma: no cover
    r = await mesh_cli("dashboard", "--allow-host", "http://x/")
    assert r.returncode == 2 and b"--allow-host" in r.stderr and b"Traceback" not in r.stderr


async def test_api_errors_name_what_was_wrong_in_plain_words(
    redis_url: str, namespace: str
) -> None:
    """Bad requests are answered 400 with one line naming the field, never
    a Python message (``'task'``, ``list indices ...``, ``invalid literal``)."""
    async with dashboard(redis_url, namespace) as (_, url):
        act = {"X-Mesh-Action": "1", "Content-Type": "application/json"}
        cases: list[tuple[str, bytes | None, str]] = [
            ("api/cancel", b'{"queue": "q"}', "name the task: 'ref', 'key', 'task_b64' or 'task'"),
            ("api/cancel", b"[1, 2]", 'the body must be a JSON object like {"queue": "Q"'),
            ("api/cancel", b"not json", "the body is not JSON"),
            ("api/pause", b"{}", "missing 'queue'"),
            ("api/pause", b'{"queue": 3}', "'queue' must be a string, got int"),
            ("api/job/delete", b'{"queue": "q", "task_b64": "%%"}', "'task_b64' is not base64"),
            ("api/job/delete", b'{"queue": "q", "ref": "nope"}', "invalid job ref 'nope'"),
            ("api/jobs?queue=q&limit=ten", None, "limit must be a whole number, got 'ten'"),
            ("api/jobs?queue=q&state=done", None, "invalid job state 'done'"),
            ("api/history?minutes=1e3", None, "minutes must be a whole number, got '1e3'"),
            ("api/job?queue=q", None, "missing 'task_b64'"),
            ("api/payload?queue=q&ref=queued.1.xyz", None, "invalid job ref"),
        ]
        for path, data, want in cases:
            status, body = await trio.to_thread.run_sync(
                partial(http, url + path, data=data, headers=act if data is not None else {})
            )
            assert status == 400, (path, status, body)
            error = json.loads(body)["error"]
            assert error.startswith("bad request: ") and want in error, (path, error)
            for internal in ("list indices", "invalid literal", "Traceback", "Expecting value"):
                assert internal not in error, (path, error)


async def test_state_and_events_carry_no_whole_payload_and_a_row_cancels_by_key(
    redis_url: str, namespace: str
) -> None:
    """A persistent task of 10 MB: /state and the first event carry its
    first characters, its size and a short key (not 14 MB); a cancel by that
    key removes it."""
    big = b"device:" + b"d" * 10_000_000
    async with dashboard(redis_url, namespace) as (client, url):
        await client.ensure("devices", big)
        await client.ensure("devices", "small")

        async def big_rows() -> list[dict[str, Any]] | None:
            status, body = await trio.to_thread.run_sync(http, url + "state")
            assert status == 200 and len(body) < 10_000, len(body)
            return [r for r in json.loads(body)["persistent"] if r["size"] == len(big)] or None

        (row,) = await wait_until(big_rows)
        assert row["task"].startswith("device:ddd") and row["task"].endswith("…")
        assert len(row["key"]) == 16 and "task_b64" not in row

        def first_event() -> bytes:
            with urllib.request.urlopen(url + "events", timeout=10) as r:
                lines = [r.readline(), r.readline()]
                return b"".join(lines)

        first = await trio.to_thread.run_sync(first_event)
        assert first.startswith(b"event: state\ndata: {") and len(first) < 10_000
        assert b"d" * 1000 not in first
        status, body = await trio.to_thread.run_sync(
            partial(
                http,
                url + "api/cancel",
                json.dumps({"queue": "devices", "key": row["key"]}).encode(),
                {"X-Mesh-Action": "1", "Content-Type": "application/json"},
            )
        )
        assert status == 200 and json.loads(body) == {"cancelled": 1}
        assert await client.persistent_tasks("devices") == {b"small": None}
