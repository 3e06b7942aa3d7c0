"""A namespace whose epoch is missing is said outside the workers too:
``mesh status`` (and ``--json``), the exporter's
``mesh_namespace_epoch_missing`` and the dashboard's state, each naming
``mesh adopt-namespace`` (issue 32, item 4). One judgement for the three:
:func:`mesh._epoch.epoch_missing`."""

from __future__ import annotations

import json

import pytest
import trio

import mesh
from mesh._epoch import Epoch, epoch_missing, observing
from mesh._view import counts, overview, snapshot
from mesh.dashboard._state import Poller
from mesh.metrics import MeshCollector
from mesh.testing import RedisServer, run_redis_server

from .cli_helpers import mesh_cli, text
from .metrics_helpers import scrape, served, until_scraped, value


def test_the_judgement() -> None:
    epoch = Epoch("{ns}:epoch", strict=True)
    assert not epoch_missing(epoch, b"v")
    assert epoch_missing(epoch, None)  # the key is not there now
    assert not epoch_missing(epoch, mesh.CommandError("NOPERM", "NOPERM"))  # not known
    epoch.check([None, b"v"], "here")
    with pytest.raises(mesh.MeshConnectionError, match="mesh adopt-namespace"):
        epoch.check([None], "here")  # the node lacks the epoch known: refused
    assert epoch.refused and epoch_missing(epoch, b"v")
    assert not epoch_missing(None, b"v")


def test_an_observer_reads_the_epoch_and_never_writes_it() -> None:
    assert Epoch("k", strict=False).commands()[0][:2] == ("SET", "k")
    with observing():
        epoch = Epoch("k", strict=False)
    assert epoch.commands() == [("GET", "k")]
    epoch.check([None], "here")  # nothing there: nothing remembered, no refusal
    assert epoch.known is None and not epoch.refused


async def test_status_says_a_master_restarted_empty(own_redis: RedisServer, namespace: str) -> None:
    url = own_redis.url
    args = ["--redis", url, "--namespace", namespace]
    async with mesh.open_worker(url, namespace=namespace) as w:

        async def hold(p: mesh.Process) -> None:
            await trio.sleep_forever()

        await w.start_work("devices", hold)
        await w.client.ensure("devices", "d1")
        r = await mesh_cli("status", *args)
        assert r.returncode == 0 and "WARNING" not in r.stdout.decode(), text(r)
        assert (
            json.loads((await mesh_cli("status", "--json", *args)).stdout)["epoch_missing"] is False
        )
    # the master restarts empty (no persistence); its workers, on Sentinel,
    # refuse it and are not registered there
    own_redis.stop()
    own_redis.start()
    r = await mesh_cli("status", *args)
    out = r.stdout.decode()
    assert r.returncode == 0, text(r)
    assert "WORKERS: none" in out
    (line,) = [x for x in out.splitlines() if x.startswith("WARNING")]
    assert line.startswith(f"WARNING: the epoch of namespace {namespace} is missing: "), line
    assert "`mesh adopt-namespace`" in line, line
    # and again: the look wrote nothing, so the next one says it too
    r = await mesh_cli("status", "--json", *args)
    assert json.loads(r.stdout)["epoch_missing"] is True
    async with mesh.open_client(url, namespace=namespace) as client:
        assert await client._conn.execute("EXISTS", client._keys.epoch) == 1  # a client writes it
    r = await mesh_cli("status", "--json", *args)
    assert json.loads(r.stdout)["epoch_missing"] is False


async def test_exporter_and_dashboard_say_a_missing_epoch(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        async with mesh.open_worker(redis_url, namespace=namespace):
            assert not (await counts(client.reads)).epoch_missing
            assert not (await snapshot(client.reads)).epoch_missing
            poller = Poller(client, header={})
            await poller.poll_once()
            state = json.loads(poller.state)
            assert state["epoch_missing"] is False and state["alerts"] == []
            async with served(MeshCollector(client)) as url:
                assert value(await scrape(url), "mesh_namespace_epoch_missing") == 0
                # the key goes (deleted, evicted) under everyone's feet
                await client._conn.execute("DEL", client._keys.epoch)
                assert value(await scrape(url), "mesh_namespace_epoch_missing") == 1
            assert (await overview(client.reads)).epoch_missing
            await poller.poll_once()
            state = json.loads(poller.state)
            assert state["epoch_missing"] is True
            (alert,) = state["alerts"]
            assert alert.startswith("The namespace's epoch is missing") and (
                "mesh adopt-namespace" in alert
            )


async def test_the_exporter_says_it_when_its_connection_is_refused(namespace: str) -> None:
    with run_redis_server() as server:
        async with mesh.open_client(
            f"{server.url}?connect_timeout=0.3", namespace=namespace
        ) as client:
            epoch = client._conn.topology.epoch
            assert epoch is not None
            epoch.strict = True  # as on Sentinel: a node without the epoch is refused
            async with served(MeshCollector(client)) as url:
                assert value(await scrape(url), "mesh_namespace_epoch_missing") == 0
                server.stop()
                server.start()  # empty
                s = await until_scraped(
                    url,
                    lambda s: value(s, "mesh_namespace_epoch_missing") == 1,
                    what="the refusal",
                )
                assert value(s, "mesh_redis_up") == 0
