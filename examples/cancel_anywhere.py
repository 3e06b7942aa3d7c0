"""Cancel a task by its payload, wherever in the mesh it is.

Three workers serve the queue ``renders``, one render at a time each. Four
renders are enqueued: three start at once, one on each worker, and the
fourth waits in the queue. Then:

* ``client.cancel`` of the waiting render removes it from the queue: it never
  starts.
* ``client.cancel`` of a running render cancels its handler on whatever
  worker runs it. The client does not know or care which one: the cancel is
  published to that worker at once, and also left in its durable inbox, which
  its next heartbeat reads if the message was missed. The handler sees
  ``trio.Cancelled``, cleans up, and re-raises.
* ``client.cancel`` of a payload that is nowhere returns 0.

The other renders finish normally. Run it::

    python examples/cancel_anywhere.py          # embedded redis-server
    MESH_REDIS_URL=redis://host:port python examples/cancel_anywhere.py
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Callable

import _support
import attrs
import trio

import mesh

QUEUE = "renders"
FRAME_TIME = 0.05  # seconds per frame


@attrs.frozen
class Report:
    """What the run saw.

    Attributes:
        events: ``(worker id, payload, event)`` in order; events are
            ``started``, ``finished`` and ``cancelled``.
        cancelled_queued, cancelled_running, cancelled_nothing: what each
            ``client.cancel`` returned.
        latency: seconds from ``client.cancel`` returning to the handler
            seeing the cancellation.
    """

    events: tuple[tuple[str, str, str], ...]
    cancelled_queued: int
    cancelled_running: int
    cancelled_nothing: int
    latency: float

    def of(self, payload: str) -> list[str]:
        """The events of one payload, in order."""
        return [e for _, p, e in self.events if p == payload]


def render_task(name: str, frames: int) -> str:
    """The payload of a render: ``NAME/FRAMES``."""
    return f"{name}/{frames}"


async def run(
    url: str,
    *,
    namespace: str = "example-cancel",
    workers: int = 3,
    say: Callable[[str], None] | None = None,
) -> Report:
    """Run the scenario of the module docstring against Redis at ``url``.

    Raises:
        TimeoutError: something did not happen in time.
    """
    narrate = _support.Narrator(say)
    events: list[tuple[str, str, str]] = []
    progress: dict[str, int] = {}
    cancel_seen = trio.Event()
    cancel_seen_at = 0.0

    async def render(process: mesh.Process) -> None:
        """Render the frames of one film, one frame every FRAME_TIME seconds."""
        nonlocal cancel_seen_at
        name, frames = process.task.decode().rsplit("/", 1)
        me = process.worker_id
        events.append((me, process.task.decode(), "started"))
        narrate(f"{me}: render {name} started ({frames} frames, token {process.token})")
        frame = 0
        try:
            for frame in range(1, int(frames) + 1):
                await trio.sleep(FRAME_TIME)
                progress[name] = frame
        except trio.Cancelled:
            cancel_seen_at = trio.current_time()
            # Cancelled by the mesh: clean up, then let Cancelled go on. Any
            # await in here would be cancelled too, so shield what must run.
            with trio.CancelScope(shield=True):
                await trio.sleep(0.01)  # stands for deleting the partial output
            events.append((me, process.task.decode(), "cancelled"))
            narrate(f"{me}: render {name} cancelled at frame {frame}; partial output removed")
            cancel_seen.set()
            raise
        events.append((me, process.task.decode(), "finished"))
        narrate(f"{me}: render {name} finished")

    films = [
        render_task("film-1", 20),
        render_task("film-2", 10_000),  # would take about 8 minutes
        render_task("film-3", 30),
        render_task("film-4", 20),
    ]
    async with (
        mesh.open_client(url, namespace=namespace) as client,
        trio.open_nursery() as nursery,
    ):
        await client.delete_queue(QUEUE)  # whatever an earlier run left behind
        ready = 0

        async def worker(i: int, *, task_status: trio.TaskStatus[None]) -> None:
            nonlocal ready
            wid = f"worker-{i}-{secrets.token_hex(2)}"
            async with mesh.open_worker(url, namespace=namespace, worker_id=wid) as w:
                await w.start_work(QUEUE, render, concurrency=1)
                task_status.started()
                await trio.sleep_forever()

        for i in range(1, workers + 1):
            await nursery.start(worker, i)
        narrate(f"{workers} workers serve {QUEUE!r}, one render at a time each")

        await client.enqueue_many(QUEUE, films)
        narrate(f"enqueued {', '.join(films)}")

        async def three_running() -> bool:
            return len(await client.processes(QUEUE)) == min(workers, 3)

        await _support.wait_until(three_running, within=10, what="three renders to start")

        async def film_2_rendering() -> bool:
            return progress.get("film-2", 0) >= 10

        await _support.wait_until(film_2_rendering, within=10, what="film-2 to render")
        waiting = await client.tasks(QUEUE)
        narrate(f"queued, waiting for a free worker: {[t.decode() for t in waiting]}")

        n_queued = await client.cancel(QUEUE, films[3])
        narrate(f"client.cancel({QUEUE!r}, {films[3]!r}) -> {n_queued} (removed from the queue)")

        where = {p.task.decode(): p.worker_id for p in await client.processes(QUEUE)}
        n_running = await client.cancel(QUEUE, films[1])
        sent = trio.current_time()
        narrate(
            f"client.cancel({QUEUE!r}, {films[1]!r}) -> {n_running} "
            f"(it runs on {where[films[1]]}; the client did not need to know)"
        )
        with trio.fail_after(10):
            await cancel_seen.wait()
        latency = cancel_seen_at - sent
        narrate(f"the handler saw the cancellation {1000 * latency:.1f} ms after cancel returned")

        n_nothing = await client.cancel(QUEUE, "film-9/1")
        narrate(f"client.cancel({QUEUE!r}, 'film-9/1') -> {n_nothing} (nowhere in the mesh)")

        async def all_done() -> bool:
            info = await client.queue_info(QUEUE)
            return info.queued == info.running == info.delayed == 0

        await _support.wait_until(all_done, within=10, what="the other renders to finish")
        narrate("queue empty, nothing running; stopping the workers")
        nursery.cancel_scope.cancel()

    return Report(tuple(events), n_queued, n_running, n_nothing, latency)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``cancel_anywhere.py [--namespace NS]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespace", default="example-cancel")
    args = parser.parse_args(argv)
    with _support.redis_url() as url:
        report = trio.run(lambda: run(url, namespace=args.namespace))
    ok = (
        report.of(render_task("film-2", 10_000)) == ["started", "cancelled"]
        and report.of(render_task("film-4", 20)) == []
        and (report.cancelled_queued, report.cancelled_running, report.cancelled_nothing)
        == (1, 1, 0)
    )
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
