"""Prometheus metrics, scraped over HTTP: a worker's (``mesh_worker_*``)
change with the events they count; the mesh-wide exporter's (``mesh_*``)
read Redis, with no worker running."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import trio
from prometheus_client import CollectorRegistry

import mesh
from mesh._keys import Keys
from mesh._view import counts
from mesh.metrics import MeshCollector, WorkerCollector, serve_metrics
from mesh.testing import run_redis_server

from .cli_helpers import clean_env, mesh_cli, running_process, stderr_until
from .metrics_helpers import scrape, served, until_scraped, value
from .protocol_helpers import expire_worker

pytestmark = pytest.mark.both_loops

TTL = 0.9


async def test_worker_metrics_change_with_the_events_they_count(
    redis_url: str, namespace: str
) -> None:
    release = anyio.Event()

    async def handler(p: mesh.Process) -> None:
        if p.task == b"fail":
            raise RuntimeError("boom")
        if p.task == b"hold":
            await release.wait()

    async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as w:
        await w.start_work("jobs", handler, max_attempts=1)
        async with served(WorkerCollector(w)) as url:
            s = await scrape(url)
            assert value(s, "mesh_worker_processes_started_total", queue="jobs") == 0
            assert value(s, "mesh_worker_fences_total", reason="lease_expired") == 0
            assert value(s, "mesh_worker_info", worker_id=w.id, generation="1") == 1
            await w.client.enqueue_many("jobs", ["ok", "fail", "hold"])
            s = await until_scraped(
                url,
                lambda s: (
                    value(s, "mesh_worker_processes_failed_total", queue="jobs") == 1
                    and value(s, "mesh_worker_processes_finished_total", queue="jobs") == 1
                ),
                what="one finished, one failed",
            )
            assert value(s, "mesh_worker_processes_started_total", queue="jobs") == 3
            assert value(s, "mesh_worker_processes_running", queue="jobs") == 1
            assert value(s, "mesh_worker_handler_seconds_count", queue="jobs") == 2
            assert value(s, "mesh_worker_handler_seconds_bucket", queue="jobs", le="+Inf") == 2
            assert value(s, "mesh_worker_claim_seconds_count", queue="jobs") >= 1
            beats = value(s, "mesh_worker_heartbeat_seconds_count")
            await until_scraped(
                url,
                lambda s: value(s, "mesh_worker_heartbeat_seconds_count") > beats,
                what="a heartbeat",
            )
            await w.client.cancel("jobs", "hold")
            s = await until_scraped(
                url,
                lambda s: value(s, "mesh_worker_processes_cancelled_total", queue="jobs") == 1,
                what="cancelled",
            )
            assert value(s, "mesh_worker_processes_running", queue="jobs") == 0
            # a lost lease: one fence, by its reason
            await expire_worker(w.client._conn, Keys(namespace), w.id)
            s = await until_scraped(
                url,
                lambda s: value(s, "mesh_worker_fences_total", reason="lease_expired") == 1,
                what="a fence",
            )
            # then it rejoins under a new id, its second generation
            await until_scraped(
                url,
                lambda s: value(s, "mesh_worker_info", worker_id=w.id, generation="2") == 1,
                what="the new generation",
            )


async def test_exporter_reads_redis_with_no_worker(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        async with served(MeshCollector(client)) as url:
            s = await scrape(url)
            assert value(s, "mesh_redis_up") == 1
            assert value(s, "mesh_workers_alive") == 0
            await client.enqueue_many("jobs", ["a", "b", "c"])
            before = await client.time()
            await client.ensure_many("devices", ["d1", "d2"])
            s = await scrape(url)
            assert value(s, "mesh_queue_length", queue="jobs") == 3
            assert value(s, "mesh_queue_length", queue="devices") == 2
            assert value(s, "mesh_persistent_tasks", queue="devices", state="unowned") == 2
            assert value(s, "mesh_persistent_tasks", queue="devices", state="owned") == 0
            assert value(s, "mesh_queue_paused", queue="jobs") == 0
            await client.pause("jobs")
            assert value(await scrape(url), "mesh_queue_paused", queue="jobs") == 1
            await client.resume("jobs")
            assert value(s, "mesh_queue_dead_letters", queue="jobs") == 0
            # how long they have had no owner is kept in Redis: a new
            # exporter (no memory of earlier scrapes) reads the same time
            t0 = await client.time()
            await anyio.sleep(0.3)  # not a synchronisation: time passes unowned
            async with served(MeshCollector(client)) as url2:
                s = await scrape(url2)
            unowned = value(s, "mesh_persistent_unowned_seconds", queue="devices")
            assert 0.3 <= unowned <= await client.time() - before
            # a worker takes one device and fails one job to the dead letters
            async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as w:

                async def fail(p: mesh.Process) -> None:
                    raise RuntimeError("boom")

                async def hold(p: mesh.Process) -> None:
                    await anyio.sleep_forever()

                await w.start_work("devices", hold, concurrency=1)
                await w.start_work("jobs", fail, max_attempts=1, concurrency=1)
                s = await until_scraped(
                    url,
                    lambda s: value(s, "mesh_queue_dead_letters", queue="jobs") == 3,
                    what="dead letters",
                )
                assert value(s, "mesh_workers_alive") == 1
                assert value(s, "mesh_persistent_tasks", queue="devices", state="owned") == 1
                assert value(s, "mesh_persistent_tasks", queue="devices", state="unowned") == 1
                assert value(s, "mesh_queue_running", queue="devices") == 1
                (held,) = [p.task for p in await client.processes("devices")]
                stopping = await client.time()
            # the stop handed the device back: unowned since then, not since
            # it was ensured
            (devices,) = [
                q for q in (await counts(client.reads)).queues if q.info.name == "devices"
            ]
            assert set(devices.unowned_since) == {b"d1", b"d2"}
            assert devices.unowned_since[held] >= stopping - 0.001  # kept in ms
            (never,) = {b"d1", b"d2"} - {held}
            assert devices.unowned_since[never] <= t0
            s = await scrape(url)
            assert value(s, "mesh_workers_alive") == 0
            assert value(s, "mesh_persistent_tasks", queue="devices", state="unowned") == 2


async def test_exporter_says_when_redis_is_down() -> None:
    with run_redis_server() as server:
        async with mesh.open_client(server.url, namespace="x") as client:
            async with served(MeshCollector(client)) as url:
                assert value(await scrape(url), "mesh_redis_up") == 1
                server.stop()
                s = await scrape(url)
                assert value(s, "mesh_redis_up") == 0
                assert not any(name.startswith("mesh_queue") for name, _ in s)


async def served_url(proc: trio.Process) -> str:
    """The metrics URL a ``mesh`` command logged."""
    log = await stderr_until(proc, rb"/metrics")
    m = re.search(rb"http://\S+/metrics", log)
    assert m is not None, log
    return m.group().decode()


@pytest.mark.slow
@pytest.mark.trio_only("runs the mesh command as a process: the test's own loop does not matter")
async def test_mesh_exporter_command_serves_and_stops(redis_url: str, namespace: str) -> None:
    async with running_process(
        [
            *(sys.executable, "-m", "mesh.cli", "exporter", "--port", "0"),
            *("--redis", redis_url, "--namespace", namespace),
        ],
        stderr=subprocess.PIPE,
        env=clean_env(),
    ) as proc:
        url = await served_url(proc)
        assert url.startswith("http://127.0.0.1:")
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            await client.enqueue("q", "x")
        # a scrape whose read of Redis takes over the exporter's 0.5 s (the
        # first, on a loaded machine) says mesh_redis_up 0 and no queue
        await until_scraped(
            url, lambda s: value(s, "mesh_queue_length", queue="q") == 1, what="q's length"
        )
        proc.terminate()
        with anyio.fail_after(10):
            assert await proc.wait() == 0


@pytest.mark.slow
@pytest.mark.trio_only("runs the mesh command as a process: the test's own loop does not matter")
async def test_mesh_worker_metrics_port(redis_url: str, namespace: str, tmp_path: Path) -> None:
    (tmp_path / "metrics_app.py").write_text(
        "async def work(p):\n    pass\n\nqueues = {'jobs': work}\n"
    )
    async with running_process(
        [
            *(sys.executable, "-m", "mesh.cli", "worker", "metrics_app:queues"),
            *("--metrics-port", "0", "--redis", redis_url, "--namespace", namespace),
        ],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        env=clean_env(),
    ) as proc:
        url = await served_url(proc)
        assert url.startswith("http://127.0.0.1:")
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            await client.enqueue_many("jobs", ["a", "b"])
        await until_scraped(
            url,
            lambda s: value(s, "mesh_worker_processes_finished_total", queue="jobs") == 2,
            what="two finished",
        )
        proc.terminate()
        with anyio.fail_after(10):
            assert await proc.wait() == 0


@pytest.mark.trio_only("runs the mesh command as a process: the test's own loop does not matter")
async def test_metrics_options_are_checked() -> None:
    r = await mesh_cli("exporter", "--port", "70000")
    assert r.returncode == 2 and b"0 to 65535" in r.stderr
    r = await mesh_cli("worker", "x:y", "--metrics-port", "-1")
    assert r.returncode == 2 and b"0 to 65535" in r.stderr


async def test_a_metrics_port_in_use_is_a_config_error() -> None:
    registry = CollectorRegistry(auto_describe=False)
    async with serve_metrics(registry, port=0) as (_, port):
        with pytest.raises(mesh.ConfigError, match="cannot serve metrics"):
            async with serve_metrics(registry, port=port):
                pass  # pragma: no cover


@pytest.mark.slow
@pytest.mark.trio_only("runs the mesh command as a process: the test's own loop does not matter")
async def test_a_process_moved_by_a_rebalance_is_counted_and_logged_as_moved(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """Issue 27: a process handed back for balance was counted in no metric
    and logged as "cancelled"."""
    (tmp_path / "hold_app.py").write_text(
        "import anyio\n\nasync def hold(p):\n    await anyio.sleep_forever()\n\n"
        "queues = {'devices': hold}\n"
    )
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.ensure_many("devices", ["d1", "d2", "d3", "d4"])
    async with running_process(
        [
            *(sys.executable, "-m", "mesh.cli", "worker", "hold_app:queues", "--ttl", "1"),
            *("--metrics-port", "0", "--redis", redis_url, "--namespace", namespace),
        ],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        env=clean_env(),
    ) as proc:
        url = await served_url(proc)
        await until_scraped(
            url,
            lambda s: value(s, "mesh_worker_processes_running", queue="devices") == 4,
            what="the CLI worker holding the four devices",
        )

        async def hold(p: mesh.Process) -> None:
            await anyio.sleep_forever()

        async with mesh.open_worker(redis_url, namespace=namespace, ttl=1.0) as peer:
            await peer.start_work("devices", hold)
            s = await until_scraped(
                url,
                lambda s: value(s, "mesh_worker_processes_moved_total", queue="devices") == 2,
                within=20,
                what="two devices moved to the new peer",
            )
            assert value(s, "mesh_worker_processes_cancelled_total", queue="devices") == 0
            log = await stderr_until(proc, rb"(moved devices .*\n.*){2}", within=20)
            assert b"cancelled devices" not in log, log.decode()
            assert peer.statistics().queues["devices"].running == 2
        proc.terminate()
        with anyio.fail_after(10):
            assert await proc.wait() == 0


async def test_the_delayed_gauge_counts_delayed_jobs_and_says_so(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue("jobs", "later", delay=3600)
        async with served(MeshCollector(client)) as url:
            assert value(await scrape(url), "mesh_queue_delayed", queue="jobs") == 1

            def get() -> str:
                with urllib.request.urlopen(url, timeout=10) as r:
                    return str(r.read().decode())

            body = await anyio.to_thread.run_sync(get)
    (help_line,) = [x for x in body.splitlines() if x.startswith("# HELP mesh_queue_delayed ")]
    assert "enqueued with a delay" in help_line and "retry" in help_line, help_line


@pytest.mark.slow
@pytest.mark.trio_only("runs the mesh command as a process: the test's own loop does not matter")
async def test_mesh_exporter_outlives_redis_and_logs_each_outage_once() -> None:
    """Issue 27: the exporter exited 1 when Redis was down at start (so the
    documented ``mesh_redis_up == 0`` alert could never fire), and with Redis
    gone later a scrape waited for the connect timeout and logged nothing."""
    with run_redis_server() as server:
        server.stop()  # down before the exporter starts
        async with running_process(
            [
                *(sys.executable, "-m", "mesh.cli", "exporter", "--port", "0"),
                *("--redis", server.url, "--namespace", "x"),
            ],
            stderr=subprocess.PIPE,
            env=clean_env(),
        ) as proc:
            log = await stderr_until(proc, rb"/metrics")
            m = re.search(rb"http://\S+/metrics", log)
            assert m is not None, log
            url = m.group().decode()
            for _ in range(3):
                s = await scrape(url)
                assert value(s, "mesh_redis_up") == 0
                assert not any(name.startswith("mesh_queue") for name, _ in s)
            server.start()
            await until_scraped(
                url, lambda s: value(s, "mesh_redis_up") == 1, within=20, what="Redis back"
            )
            async with mesh.open_client(server.url, namespace="x") as client:
                await client.enqueue("q", "a")
            assert value(await scrape(url), "mesh_queue_length", queue="q") == 1
            server.stop()  # gone while the exporter is connected
            for _ in range(3):
                assert value(await scrape(url), "mesh_redis_up") == 0
            proc.terminate()
            with anyio.fail_after(10):
                assert await proc.wait() == 0
            assert proc.stderr is not None
            while chunk := await proc.stderr.receive_some():
                log += chunk
    lines = log.decode().splitlines()
    # two outages (at start, and later), each logged once; one recovery
    down = [x for x in lines if "mesh_redis_up is 0 until it is back" in x]
    back = [x for x in lines if "Redis is back" in x]
    assert len(down) == 2 and len(back) == 1, log.decode()
    assert all("WARNING" in x for x in down), down


async def test_a_thousand_groups_give_at_most_top_n_group_series(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue_many("plain", ["x"])
        for i in range(1000):
            await client.enqueue_many(
                "g", [f"j{i}-{k}" for k in range(1 + (i == 7) * 4)], group=f"t{i}"
            )
        await client.configure_group("g", "t3", concurrency=2)
        await client.pause_group("g", "t7")
        async with served(MeshCollector(client, top_groups=5)) as url:
            s = await scrape(url)
        group_series = [k for k in s if k[0].startswith("mesh_group_")]
        per_name = {name for name, _ in group_series}
        assert per_name == {f"mesh_group_{x}" for x in ("queued", "running", "delayed", "paused")}
        assert len(group_series) == 4 * 5
        assert value(s, "mesh_queue_groups", queue="g") == 1000
        assert value(s, "mesh_queue_groups", queue="plain") == 0
        assert value(s, "mesh_queue_group_jobs", queue="g", state="queued") == 1004
        assert value(s, "mesh_queue_length", queue="g") == 1004  # the groups' jobs counted
        assert value(s, "mesh_group_queued", queue="g", group="t7") == 5  # the most first
        assert value(s, "mesh_group_paused", queue="g", group="t7") == 1
        assert not [k for k in s if k[0] == "mesh_queue_group_jobs" and ("queue", "plain") in k[1]]
        with pytest.raises(ValueError, match="top_groups must be 0 to 1000"):
            MeshCollector(client, top_groups=1001)
