"""A worker, fleet or client that waits for replicas warns once at start
when the master syncs replicas diskless with a delay (issue 32, item 3):
after a planned failover, writes that wait for replicas stall about that
long."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

import mesh
from mesh._diskless import diskless_delay
from mesh.testing import RedisServer, run_redis_server

DISKLESS = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "5")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "mesh.replicas" and r.levelno == logging.WARNING
    ]


def test_the_reply_is_read_in_both_forms() -> None:
    assert diskless_delay([b"repl-diskless-sync", b"yes", b"repl-diskless-sync-delay", b"5"]) == 5
    assert diskless_delay({"repl-diskless-sync": "yes", "repl-diskless-sync-delay": "2"}) == 2
    assert diskless_delay([b"repl-diskless-sync", b"no", b"repl-diskless-sync-delay", b"5"]) is None
    assert (
        diskless_delay([b"repl-diskless-sync", b"yes", b"repl-diskless-sync-delay", b"0"]) is None
    )
    assert diskless_delay(b"junk") is None


@pytest.fixture
def diskless_redis() -> Iterator[RedisServer]:
    with run_redis_server(DISKLESS) as server:
        yield server


async def test_each_kind_of_process_warns_once_naming_the_setting(
    diskless_redis: RedisServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "mesh.replicas")
    url = f"{diskless_redis.url}?connect_timeout=0.5"
    async with mesh.open_client(url, namespace=namespace, min_replicas=1):
        pass
    (line,) = _warnings(caplog)
    assert line.startswith(
        f"client with min_replicas=1: the master at 127.0.0.1:{diskless_redis.port}"
    )
    assert "repl-diskless-sync-delay 5 (seconds)" in line
    assert "set repl-diskless-sync-delay 0" in line
    caplog.clear()
    async with mesh.open_worker(url, namespace=namespace, min_replicas=1, worker_id="w1"):
        pass
    (line,) = _warnings(caplog)
    assert line.startswith("worker w1 with min_replicas=1") and "delay 5" in line, line
    caplog.clear()
    async with mesh.open_fleet(url, namespace=namespace, min_replicas=2, name="f1") as fleet:
        async with fleet.open_worker(), fleet.open_worker():
            pass
    (line,) = _warnings(caplog)  # once for the fleet, not per worker
    assert line.startswith("fleet f1 with min_replicas=2"), line
    # without min_replicas nothing waits for replicas: nothing is said
    caplog.clear()
    async with mesh.open_client(url, namespace=namespace):
        pass
    assert _warnings(caplog) == []


async def test_no_warning_without_a_delay_or_when_config_is_refused(
    namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "mesh.replicas")
    args = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0")
    with run_redis_server(args) as server:
        async with mesh.open_client(server.url, namespace=namespace, min_replicas=1):
            pass
    with run_redis_server(DISKLESS) as server:
        async with mesh.open_client(server.url, namespace=namespace) as admin:
            await admin._conn.execute(
                "ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-config"
            )
        url = f"redis://app:pw@127.0.0.1:{server.port}"
        async with mesh.open_client(url, namespace=namespace, min_replicas=1) as client:
            await client.queues()  # and it works
    assert _warnings(caplog) == []
