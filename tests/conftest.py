"""Test fixtures: a real redis-server that the tests start themselves.

One server is shared by the whole session; every test gets its own namespace,
so tests cannot see each other's keys. Tests that kill, stop or reconfigure
Redis use ``own_redis``, a server of their own.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator

import pytest

from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh._scripts import Binding
from mesh.testing import RedisServer, run_redis_server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with run_redis_server() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with run_redis_server() as server:
        yield server


@pytest.fixture
def namespace() -> str:
    return "t" + secrets.token_hex(4)


@pytest.fixture
async def conn(redis_url: str) -> AsyncIterator[Connection]:
    """A raw connection to the shared server, named ``test-conn``."""
    async with open_connection(redis_url, name="test-conn") as c:
        yield c


@pytest.fixture
def keys(namespace: str) -> Keys:
    """The test's namespace's keys."""
    return Keys(namespace)


@pytest.fixture
def b(keys: Keys) -> Binding:
    """The protocol scripts, bound to the test's namespace."""
    return Binding(keys)
