"""Test fixtures: a real redis-server that the tests start themselves.

One server is shared by the whole session; every test gets its own namespace,
so tests cannot see each other's keys. Tests that kill, stop or reconfigure
Redis use ``own_redis``, a server of their own.

Tests wait on events, on :func:`mesh.testing.wait_until` (state in Redis or
in a worker), or on :func:`mesh.testing.wait_heartbeats` (in-process workers)
and ``Harness.wait_renewals`` (worker processes, tests/faults): a window in
which nothing may move is counted in the workers' rounds, so a loaded machine
makes it longer, never too short. Sleeps that are the scenario (a producer's
pace, a handler's work, how long a pause or an outage lasts) say "not a
synchronisation". What is left are these deliberate windows, each commented
``# a deliberate window: ...`` where it sleeps; each shows that nothing
happens for a while, with no event to wait for:

- test_connection.py:729 and :793 (idle past the reply timeout): an idle or a
  busy connection is not broken; what is asserted is that time passed.
- test_memory.py:410 (one poll interval): one INFO per interval for a whole
  fleet; the count of calls over a period is the assertion.
- test_worker.py:731 (late reapers): the reap checks over 0.3 s after a death are
  counted; a late waker is exactly what may not be waited for.
- test_worker.py:793 and :804 (no other claim may follow): the commands sent after
  an enqueue and a cancel are counted; a stray claim has no event.
- test_runner.py:147 (nothing more is sent): the writes of a finish and a claim
  that share one write are counted.
- test_jobs.py:558 (the call must not return): ``Client.result`` keeps waiting
  while the task runs; a premature return has no event before it happens.
- test_balance.py:206 (w's retry left d3 alone): the held-back retry is a timer
  inside the runner (one interval), with nothing to see from outside.

Find them with ``grep -rn "deliberate window" tests``.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator

import pytest

from mesh._binding import Binding
from mesh._connection import Connection, open_connection
from mesh._harness.topology import RedisServer, run_redis_server
from mesh._keys import Keys

# behaviour tests on trio and asyncio (pytestmark = pytest.mark.both_loops)
pytest_plugins = ["tests.loops"]


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
