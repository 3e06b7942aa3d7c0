"""mesh.testing's helpers that wait: wait_until and wait_heartbeats, against
a real redis-server."""

from __future__ import annotations

import anyio
import pytest
import trio

import mesh
from mesh.testing import wait_heartbeats, wait_until

pytestmark = pytest.mark.both_loops


async def test_wait_until_returns_the_first_true_value_and_names_what_timed_out() -> None:
    values = iter([0, None, "", 7])
    assert await wait_until(lambda: next(values), within=1, every=0) == 7

    async def never() -> bool:
        return False

    with pytest.raises(trio.TooSlowError, match="waiting for the impossible"):
        await wait_until(never, within=0.05, what="the impossible")


async def test_wait_heartbeats_counts_each_worker_s_confirmed_heartbeats(
    redis_url: str, namespace: str
) -> None:
    async with (
        mesh.open_worker(redis_url, namespace=namespace, ttl=0.3) as a,
        mesh.open_worker(redis_url, namespace=namespace, ttl=0.6) as b,
    ):
        await wait_heartbeats(a, b)  # past the first renewal (0.5-1 H after the join)
        before = [w.statistics().heartbeats for w in (a, b)]
        t0 = anyio.current_time()
        await wait_heartbeats(a, b, count=3)
        took = anyio.current_time() - t0
        after = [w.statistics().heartbeats for w in (a, b)]
        assert after[0] >= before[0] + 3 and after[1] >= before[1] + 3
        # b renews every 0.19-0.2 s: three renewals span at least two intervals
        assert took >= 2 * 0.95 * b.timing.interval - 0.01


async def test_wait_heartbeats_times_out_naming_the_workers_behind(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_worker(redis_url, namespace=namespace, ttl=30) as w:
        with pytest.raises(trio.TooSlowError, match=f"behind: {w.id}"):
            await wait_heartbeats(w, count=2, within=0.1)
        with pytest.raises(ValueError, match="count must be >= 1"):
            await wait_heartbeats(w, count=0)
