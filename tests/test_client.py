"""The client (mesh/_client.py) on its own: what its calls report.

Most client calls are exercised with workers in test_worker.py and
test_jobs.py; here is what needs no worker."""

from __future__ import annotations

import trio

import mesh

# reconcile reports what it changed, not what it tried to change


async def test_concurrent_reconciles_report_each_cancel_once(
    redis_url: str, namespace: str
) -> None:
    # Two replicas of a service reconcile the same desired set at the same
    # moment: both read the persistent set before either cancels, so both try
    # to cancel "gone". Only the one whose cancel found it may report it.
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.ensure_many("conns", ["keep", "gone"])
        results: list[mesh.ReconcileResult] = []

        async def reconcile() -> None:
            results.append(await client.reconcile("conns", ["keep"]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reconcile)
            nursery.start_soon(reconcile)
        assert sorted(r.cancelled for r in results) == [(), (b"gone",)]
        assert all(r.added == () for r in results)
        assert await client.persistent_tasks("conns") == {b"keep": None}
