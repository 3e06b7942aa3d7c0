"""A one-shot job queue with retries and a dead-letter list.

Two workers serve the queue ``jobs``, two jobs at a time each, with at most
3 attempts per job and a backoff of 0.2 s, doubling per failed attempt. The
handler raises to fail an attempt:

* ``email:alice`` and ``email:bob`` succeed at once.
* ``charge:order-42`` fails twice (a flaky payment gateway), then succeeds on
  its third attempt. ``process.attempts`` tells the handler how many
  attempts failed before this one.
* ``parse:{broken`` can never succeed. After its third failed attempt it goes
  to the queue's dead-letter list, ``client.dead_letters``.

A handler that returns finishes its process: the job leaves the mesh. Jobs
are delivered at least once: a job whose worker dies mid-way runs again on a
peer (and the crash counts as a failed attempt). Run it::

    python examples/job_queue.py            # embedded redis-server
    MESH_REDIS_URL=redis://host:port python examples/job_queue.py
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import sys
from collections.abc import Callable

import _support
import attrs
import trio

import mesh

QUEUE = "jobs"
MAX_ATTEMPTS = 3
BACKOFF = 0.2
JOBS = ["email:alice", "email:bob", "charge:order-42", "parse:{broken"]


class GatewayTimeout(Exception):
    """The (imaginary) payment gateway did not answer."""


@attrs.frozen
class Report:
    """What the run saw.

    Attributes:
        attempts: per job, the outcome of each attempt in order (``ok`` or
            the error's class name), with the seconds since start.
        dead_letters: the queue's dead-letter list at the end.
    """

    attempts: dict[str, list[tuple[float, str]]]
    dead_letters: list[str]

    def outcomes(self, job: str) -> list[str]:
        """The outcomes of one job's attempts, in order."""
        return [o for _, o in self.attempts.get(job, [])]


async def run(
    url: str,
    *,
    namespace: str = "example-jobs",
    say: Callable[[str], None] | None = None,
) -> Report:
    """Run the scenario of the module docstring against Redis at ``url``.

    Raises:
        TimeoutError: the jobs did not settle in time.
    """
    narrate = _support.Narrator(say)
    attempts: dict[str, list[tuple[float, str]]] = {}

    async def handle(process: mesh.Process) -> None:
        """Run one job. Returning finishes it; raising fails this attempt."""
        job = process.task.decode()
        n = process.attempts + 1
        kind, _, arg = job.partition(":")
        try:
            if kind == "email":
                await trio.sleep(0.05)  # send it
            elif kind == "charge":
                if process.attempts < 2:
                    raise GatewayTimeout("payment gateway timed out")
            elif kind == "parse":
                json.loads(arg)
        except Exception as exc:
            attempts.setdefault(job, []).append((narrate.elapsed(), type(exc).__name__))
            narrate(f"{process.worker_id}: {job} attempt {n} failed: {type(exc).__name__}")
            raise
        attempts.setdefault(job, []).append((narrate.elapsed(), "ok"))
        narrate(f"{process.worker_id}: {job} attempt {n} succeeded")

    async with (
        mesh.open_client(url, namespace=namespace) as client,
        trio.open_nursery() as nursery,
    ):
        await client.delete_queue(QUEUE)  # whatever an earlier run left behind

        async def worker(i: int, *, task_status: trio.TaskStatus[None]) -> None:
            wid = f"worker-{i}-{secrets.token_hex(2)}"
            async with mesh.open_worker(url, namespace=namespace, worker_id=wid) as w:
                await w.start_work(
                    QUEUE, handle, concurrency=2, max_attempts=MAX_ATTEMPTS, backoff=BACKOFF
                )
                task_status.started()
                await trio.sleep_forever()

        for i in (1, 2):
            await nursery.start(worker, i)
        narrate(
            f"2 workers serve {QUEUE!r}, 2 jobs at a time each: at most {MAX_ATTEMPTS} attempts, "
            f"retry after {BACKOFF:g} s, doubling"
        )
        await client.enqueue_many(QUEUE, JOBS)
        narrate(f"enqueued {', '.join(JOBS)}")

        async def settled() -> bool:
            info = await client.queue_info(QUEUE)
            return info.queued == info.delayed == info.running == 0 and info.dead == 1

        await _support.wait_until(settled, within=15, what="the jobs to settle")
        dead = [d.task.decode() for d in await client.dead_letters(QUEUE)]
        narrate(f"queue empty; client.dead_letters({QUEUE!r}) -> {dead}")
        nursery.cancel_scope.cancel()

    return Report(attempts, dead)


class _OneLine(logging.Formatter):
    """Log records on one line: the traceback of a failed handler is left out."""

    def format(self, record: logging.LogRecord) -> str:
        record.exc_info = None
        record.exc_text = None
        return super().format(record)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``job_queue.py [--namespace NS]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespace", default="example-jobs")
    args = parser.parse_args(argv)
    # mesh logs every failed attempt (with its traceback) on the "mesh" logger.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_OneLine("         (log) %(message)s"))
    logging.getLogger("mesh").addHandler(handler)
    with _support.redis_url() as url:
        report = trio.run(lambda: run(url, namespace=args.namespace))
    ok = (
        report.outcomes("charge:order-42") == ["GatewayTimeout", "GatewayTimeout", "ok"]
        and report.outcomes("parse:{broken") == ["JSONDecodeError"] * MAX_ATTEMPTS
        and report.dead_letters == ["parse:{broken"]
        and all(report.outcomes(j) == ["ok"] for j in ("email:alice", "email:bob"))
    )
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
