"""What a failover must not do: lose an acknowledged enqueue, strand a process
on a live worker, or let a namespace start over from empty (issue 23).

Against real servers: one server (a finish lost, played by restoring a snapshot),
and real Sentinel set-ups (tests/topology.py) for a planned ``SENTINEL FAILOVER``
and for an old master restarted empty."""

from __future__ import annotations

import secrets

import trio

import mesh
from mesh import Process
from mesh.testing import RedisServer, wait_until

from .topology import client


async def test_a_finish_lost_is_handed_back_within_a_heartbeat(own_redis: RedisServer) -> None:
    """A failover that dropped a finish, played on one server: the namespace
    goes back to a snapshot taken while a job ran (DUMP, then DEL + RESTORE in
    one transaction) after the job finished. Redis says the live worker holds a
    process it does not run; at its next heartbeat the worker hands it back and
    the job runs again (at-least-once), and nothing stays "running"."""
    ns = "fl" + secrets.token_hex(3)
    r = client(own_redis.port)
    runs: list[int] = []
    release = trio.Event()

    async def handler(p: Process) -> None:
        runs.append(p.token)
        if len(runs) == 1:
            await release.wait()

    async with (
        mesh.open_client(own_redis.url, namespace=ns) as c,
        mesh.open_worker(own_redis.url, namespace=ns, ttl=0.9) as w,
    ):
        await w.start_work("jobs", handler)
        await c.enqueue("jobs", b"job")
        await wait_until(lambda: runs, 5, "the job to start")
        snapshot = await trio.to_thread.run_sync(
            lambda: {k: (r.dump(k), r.pttl(k)) for k in r.scan_iter(match=f"{{{ns}}}:*")}
        )
        release.set()

        async def finished() -> bool:
            info = await c.queue_info("jobs")
            return info.running == 0 and w.statistics().running == 0

        await wait_until(finished, 5, "the job to finish")

        def fail_over() -> None:
            t = r.pipeline(transaction=True)
            t.delete(*r.scan_iter(match=f"{{{ns}}}:*"))
            for key, (dumped, pttl) in snapshot.items():
                assert dumped is not None
                if key.endswith(b":worker:" + w.id.encode()):
                    pttl = 900  # the live lease, as the worker renewed it
                t.restore(key, max(pttl, 0), dumped, replace=True)
            t.execute()

        await trio.to_thread.run_sync(fail_over)
        assert (await c.queue_info("jobs")).running == 1  # stranded, as in issue 23
        # Within one heartbeat (0.3 s) the worker hands it back; it runs again.
        await wait_until(lambda: len(runs) == 2, 5 * 0.3, "the job to run again")
        await wait_until(finished, 5, "the job to finish again")
        assert w.statistics().fenced == 0
        assert runs[1] > runs[0]
