"""A handler that returned just before its worker left (or stopped serving
the queue) has its process reported finished, not handed back: its task
used to go back to the queue and run a second time."""

from __future__ import annotations

from typing import Any

import trio

import mesh


async def test_leaving_reports_what_already_finished(redis_url: str, namespace: str) -> None:
    send, receive = trio.open_memory_channel[bytes](10)

    async def report(p: mesh.Process) -> None:
        await send.send(p.task)  # the caller leaves as soon as it sees this

    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.start_work("reports", report, concurrency=4)
        await worker.client.enqueue_many("reports", ["daily", "weekly"])
        got = {await receive.receive(), await receive.receive()}
    assert got == {b"daily", b"weekly"}
    assert worker.statistics().processes_finished == 2
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        info = await client.queue_info("reports")
    assert (info.queued, info.running, info.delayed) == (0, 0, 0)


async def test_stop_work_reports_what_already_finished(redis_url: str, namespace: str) -> None:
    send, receive = trio.open_memory_channel[bytes](10)

    async def report(p: mesh.Process) -> None:
        await send.send(p.task)

    async def fail(p: mesh.Process) -> None:
        await send.send(p.task)
        raise RuntimeError("this attempt fails")

    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        # The runner's own reports hang until stop_work cancels them, so the
        # outcomes are still unreported when the runners stop.
        binding = worker._binding
        real_finish, real_give_back = binding.finish, binding.give_back
        real_finish_and_claim = binding.finish_and_claim
        hung: set[str] = set()

        async def finish(*args: Any, **kwargs: Any) -> Any:
            if "finish" not in hung:
                hung.add("finish")
                await trio.sleep_forever()
            return await real_finish(*args, **kwargs)

        async def finish_and_claim(*args: Any, **kwargs: Any) -> Any:
            # a report that goes out with the next claim (work was announced)
            if "finish" not in hung:
                hung.add("finish")
                await trio.sleep_forever()
            return await real_finish_and_claim(*args, **kwargs)

        async def give_back(*args: Any, **kwargs: Any) -> Any:
            if "give_back" not in hung:
                hung.add("give_back")
                await trio.sleep_forever()
            return await real_give_back(*args, **kwargs)

        binding.finish = finish  # type: ignore[method-assign]
        binding.finish_and_claim = finish_and_claim  # type: ignore[method-assign]
        binding.give_back = give_back  # type: ignore[method-assign]

        await worker.start_work("reports", report)
        await worker.start_work("flaky", fail, backoff=30.0, backoff_max=30.0)
        await worker.client.enqueue("reports", "daily")
        await worker.client.enqueue("flaky", "once")
        assert {await receive.receive(), await receive.receive()} == {b"daily", b"once"}
        with trio.fail_after(5):
            while hung != {"finish", "give_back"}:  # noqa: ASYNC110 - poll with a deadline
                await trio.sleep(0.01)
        assert await worker.stop_work("reports") == 0
        assert await worker.stop_work("flaky") == 0
        reports = await worker.client.queue_info("reports")
        flaky = await worker.client.queue_info("flaky")
    assert (reports.queued, reports.running) == (0, 0)
    # the failed attempt counts: the task waits for its backoff
    assert (flaky.queued, flaky.running, flaky.delayed) == (0, 0, 1)
