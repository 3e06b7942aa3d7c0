"""Rebalancing with real worker processes: after a mass failure (SIGKILL of
half the peers) the survivors end within one of the fair share, nothing is
lost, and never two owners."""

from __future__ import annotations

from collections import Counter

import pytest

from mesh._harness.harness import Harness, figure, payloads
from mesh.testing import wait_until

pytestmark = pytest.mark.slow


async def test_a_mass_kill_ends_balanced(h: Harness) -> None:
    ds = await h.start(6)
    devices = payloads("dev", 60)
    await h.client.ensure_many("devices", devices)
    ids = {d.tag: await h.worker_id(d) for d in ds}

    async def counts(among: list[str]) -> list[int]:
        snap = await h.snapshot(["devices"])
        c = Counter(p.worker for p in snap.queues["devices"].procs.values())
        return [c[w] for w in among]

    async def balanced(among: list[str], total: int) -> bool:
        n = await counts(among)
        return sum(n) == total and max(n) - min(n) <= 1

    everyone = list(ids.values())
    await wait_until(lambda: balanced(everyone, 60), 15, "6 peers with 10 each")
    survivors = [ids[d.tag] for d in ds[3:]]
    async with h.monitor({"devices": set(devices)}) as mon:
        killed_at = await h.sink_now()
        for d in ds[:3]:
            d.kill()
        await wait_until(lambda: balanced(survivors, 60), 20, "3 survivors with 20 each")
        settled_at = await h.sink_now()
    assert await counts(survivors) == [20, 20, 20]
    assert mon.violations == []
    v = await h.judge()
    assert v.overlaps == [] and v.max_owners == 1 and v.rejected == 0
    figure(
        "mass_kill_balance",
        peers=6,
        killed=3,
        tasks=60,
        balanced_after=round(settled_at - killed_at, 3),
    )
