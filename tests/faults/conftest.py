"""Fixtures of the fault tests: a sink redis-server of its own (so that
killing the mesh's Redis loses nothing the sink saw), and a harness per test
whose driver processes are always killed at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import trio

from mesh._harness.harness import Harness, open_harness
from mesh._harness.topology import RedisServer, run_redis_server

TTL = 1.0


@pytest.fixture(scope="session")
def sink_server() -> Iterator[RedisServer]:
    with run_redis_server() as server:
        yield server


@pytest.fixture
def worker_loop(request: pytest.FixtureRequest) -> str:
    """The event loop of the worker processes (drivers) of this test: "trio",
    or both in turn in a module marked ``worker_loops``."""
    return str(getattr(request, "param", "trio"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marked = metafunc.definition.get_closest_marker("worker_loops") is not None
    if marked and "worker_loop" in metafunc.fixturenames:
        metafunc.parametrize("worker_loop", ["trio", "asyncio"])


@pytest.fixture
async def h(
    redis_url: str,
    sink_server: RedisServer,
    namespace: str,
    nursery: trio.Nursery,
    worker_loop: str,
) -> AsyncIterator[Harness]:
    """A harness on the session's shared mesh Redis."""
    async with open_harness(redis_url, sink_server.url, namespace, nursery, TTL, worker_loop) as h:
        yield h


@pytest.fixture
def mesh_redis(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A mesh Redis of the test's own, started with the extra arguments of
    ``@pytest.mark.redis_args(...)``; for tests that kill, stall or
    reconfigure it."""
    marker = request.node.get_closest_marker("redis_args")
    args = list(marker.args) if marker else []
    with run_redis_server(args) as server:
        yield server


@pytest.fixture
async def ho(
    mesh_redis: RedisServer,
    sink_server: RedisServer,
    namespace: str,
    nursery: trio.Nursery,
    worker_loop: str,
) -> AsyncIterator[Harness]:
    """A harness on a mesh Redis of its own (``ho.server``)."""
    async with open_harness(
        mesh_redis.url, sink_server.url, namespace, nursery, TTL, worker_loop
    ) as h:
        h.server = mesh_redis
        yield h


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "redis_args(*args): extra redis-server arguments")
    config.addinivalue_line(
        "markers",
        "worker_loops: the module's fault tests run with trio and with asyncio workers",
    )
