"""A handler that ends while the runner's finish report for another one is
in flight is reported too (it used to be dropped: its process stayed
'running' in Redis for as long as the worker lived)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

import mesh

from .test_worker import wait_for


async def test_a_process_that_ends_during_a_finish_report_is_reported(
    redis_url: str, namespace: str
) -> None:
    reporting = trio.Event()

    async def first(p: mesh.Process) -> None:
        return None

    async def second(p: mesh.Process) -> None:
        await reporting.wait()  # ends while the report of `first` is in flight

    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        mesh.open_worker(redis_url, namespace=namespace, ttl=3.0) as w,
    ):
        binding = w._binding
        real_finish = binding.finish

        async def slow_finish(
            conn: Any, worker: str, incarnation: str, queue: str, ids: Sequence[str]
        ) -> list[bool]:
            ids = list(ids)  # what goes on the wire is fixed at call time
            reporting.set()
            await trio.sleep(0.05)
            return await real_finish(conn, worker, incarnation, queue, ids)

        binding.finish = slow_finish  # type: ignore[method-assign]

        async def handler(p: mesh.Process) -> None:
            await (first if p.task == b"first" else second)(p)

        await client.enqueue_many("jobs", ["second", "first"])
        await w.start_work("jobs", handler)

        async def all_finished() -> bool:
            i = await client.queue_info("jobs")
            return i.queued == i.running == 0

        await wait_for(all_finished, within=2, what="both processes reported finished")
        assert w.statistics().processes_finished == 2
