"""Fixtures of the fault tests: a sink redis-server of its own (so that
killing the mesh's Redis loses nothing the sink saw), and a harness per test
whose driver processes are always killed at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import trio

import mesh
from mesh._connection import open_connection
from mesh._server import RedisServer, run_redis_server

from .harness import Harness

TTL = 1.0


@pytest.fixture(scope="session")
def sink_server() -> Iterator[RedisServer]:
    with run_redis_server() as server:
        yield server


@pytest.fixture
async def h(
    redis_url: str, sink_server: RedisServer, namespace: str, nursery: trio.Nursery
) -> AsyncIterator[Harness]:
    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        open_connection(sink_server.url) as sconn,
    ):
        h = Harness(redis_url, sink_server.url, namespace, client, sconn, nursery, TTL)
        try:
            yield h
        finally:
            h.reap_all()
