"""A cancel that reaches a worker before the reply of the claim that created
the process (the cancel's pub/sub message and the heartbeat that carries it
from the durable inbox both arrive while the claim reply is still on its way)
must still stop the process. It used to be acknowledged and forgotten: the
handler then ran a task that Redis no longer knew, forever for a persistent
task."""

from __future__ import annotations

from typing import Any

import trio

import mesh


async def test_a_cancel_that_overtakes_the_claim_reply_is_not_lost(
    redis_url: str, namespace: str
) -> None:
    started: list[bytes] = []

    async def hold(p: mesh.Process) -> None:
        started.append(p.task)
        await trio.sleep_forever()

    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        mesh.open_worker(redis_url, namespace=namespace, ttl=0.6) as worker,
    ):
        real_run = worker._binding.run
        cancels: list[int] = []
        returned = trio.Event()

        async def run(conn: Any, call: Any) -> Any:
            reply = await real_run(conn, call)
            if call.script.name == "claim" and reply.processes and not cancels:
                cancels.append(await client.cancel("devices", "dev-1"))
                # The runner's trio task resumes late: two heartbeats (every
                # 0.2 s) deliver and acknowledge the cancel meanwhile.
                await trio.sleep(0.45)
                returned.set()
            return reply

        worker._binding.run = run  # type: ignore[method-assign]
        await worker.start_work("devices", hold)
        await client.ensure("devices", "dev-1")
        with trio.fail_after(5):
            await returned.wait()
        assert cancels == [1]
        await trio.sleep(0.1)  # time for the runner to (wrongly) start it
        assert started == []
        assert worker.statistics().running == 0
        assert worker.statistics().processes_cancelled == 1
        assert await client.processes("devices") == []
        assert await client.persistent_tasks("devices") == {}
