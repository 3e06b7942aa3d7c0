"""trio-mesh worker processes for the benchmarks (run by the parent as
``python -m bench.children.mesh_child ROLE ...``; see :mod:`bench._util` for the line
protocol).

Roles:

* ``produce``: enqueues ``--n`` one-shot tasks with one ``enqueue_many`` and
  prints ``enqueued <seconds>`` (connection set-up not included).
* ``throughput``: one worker; prints ``ready``, waits for ``go``, then serves
  the queue with a no-op handler (with ``--batch N``, a no-op batch handler
  of up to N processes per call; with ``--prefetch N``, claiming up to N
  processes beyond the concurrency).
* ``loop``: the limit of a worker on this connection, no framework: a bare
  loop that claims ``--concurrency`` tasks and finishes the previous ones in
  one round trip (one small Lua script, :data:`LOOP_LUA`), with no handler
  and nothing else (no lease, no heartbeat); prints ``ready``, waits for
  ``go``, and stops when a call finds the queue empty and has nothing left
  to finish.
* ``groups-work``: one worker serving the queue at ``--concurrency`` with a
  no-op handler that notes ``time.monotonic_ns()`` and the job's group as it
  ends; prints ``ready``, waits for ``go``, serves; answers ``dump`` with one
  ``g <ns> <group>`` line per job done (``-`` for no group), then ``end``.
* ``failover``: one worker serving ``devices`` (persistent tasks, concurrency
  1); prints ``ready <worker id>``; each handler start prints
  ``start <token> <monotonic ns>``. SIGTERM makes
  it leave its ``open_worker`` block (a graceful stop).
* ``hold``: ``--workers`` workers in this process, each serving the queue with
  handlers that run until cancelled; a cancelled handler notes
  ``time.monotonic_ns()``. Prints ``worker <id>`` for each, then ``ready``.
  Answers ``count`` with ``count <running handlers>``, ``beats`` with
  ``beats <heartbeats confirmed, all workers>`` and ``dump`` with one
  ``cancelled <payload> <ns>`` line per cancelled handler, then ``end``.
  With ``--fleet``, the workers are one :func:`mesh.open_fleet`'s (with
  ``--join-window``, its join window); with ``--notes``, each handler start
  prints ``start <payload> <ns>``.
* ``latency-work``: one worker serving the queue at ``--concurrency`` with a
  handler that notes ``time.monotonic_ns()`` as it starts; prints ``ready``
  once serving. Answers ``clock`` with ``clock <monotonic ns>``, ``count``
  with ``count <handlers started>`` and ``dump`` with one ``latency <i>
  <ns>`` line per started task (start - the enqueue time in its payload
  ``<i> <enqueue ns>``), then ``end``. The latency suite's line protocol,
  which ``bench/children/bullmq_driver.js`` speaks too.
* ``latency-produce``: prints ``ready``, waits for ``go``, then enqueues
  ``--n`` tasks one ``Client.enqueue`` at a time at ``--rate`` tasks/s on an
  absolute schedule (task i is due at start + i / rate), each payload
  ``<i> <monotonic ns just before the call>``; prints ``enqueued <n> <first
  ns> <last ns>`` (the first and last enqueue times).

Times are ``time.monotonic_ns()``: CLOCK_MONOTONIC, one clock for every
process of the machine (Linux), so the parent can compare them with its own.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import sniffio
import trio

import mesh
from mesh._loop import RUNNERS, run


class Stalls(trio.abc.Instrument):
    """Notes every stretch the event loop ran without looking at I/O for
    longer than ``floor`` seconds (a trio run batch): its length, how many
    task steps it ran, the garbage collection in it, and the four longest
    task names by time. Written to ``path`` as lines ``<monotonic ns> <batch
    ms> <steps> gc=<ms> <name>=<ms>/<steps> ...``; and every garbage
    collection of ``floor`` or more as ``<monotonic ns> gc gen<n> <ms>
    collected <objects>``."""

    def __init__(self, path: str, floor: float = 0.05) -> None:
        self._f = open(path, "w")
        self._floor = floor
        self._gc_began = 0.0
        self._gc = 0.0  # seconds of garbage collection in this batch
        gc.callbacks.append(self._collected)
        self._batch = time.perf_counter()
        self._step = 0.0
        self._steps: list[tuple[float, str]] = []

    def _collected(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
            return
        took = time.perf_counter() - self._gc_began
        self._gc += took
        if took >= self._floor:
            self._f.write(
                f"{time.monotonic_ns()} gc gen{info['generation']} {1000 * took:.0f}ms "
                f"collected {info['collected']}\n"
            )

    def after_io_wait(self, timeout: float) -> None:
        self._batch = time.perf_counter()
        self._gc = 0.0
        self._steps = []

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self._steps.append((time.perf_counter() - self._step, task.name))

    def before_io_wait(self, timeout: float) -> None:
        took = time.perf_counter() - self._batch
        if took >= self._floor:
            by: dict[str, tuple[float, int]] = {}
            for d, name in self._steps:
                name = name.rsplit(".", 1)[-1]
                a, n = by.get(name, (0.0, 0))
                by[name] = (a + d, n + 1)
            top = sorted(by.items(), key=lambda kv: -kv[1][0])[:4]
            desc = " ".join(f"{n}={1000 * a:.0f}ms/{c}" for n, (a, c) in top)
            self._f.write(
                f"{time.monotonic_ns()} {1000 * took:.0f} {len(self._steps)} "
                f"gc={1000 * self._gc:.0f}ms {desc}\n"
            )
            self._f.flush()


def trace_scripts(path: str) -> None:
    """Note every script call this process makes through
    ``mesh._eval.run_script`` (the binding's and the reads') (``MESH_BENCH_TRACE=DIR``): lines
    ``<sent ns> <replied ns> <script> <n>`` in ``path``, monotonic clock;
    ``n`` is what the reply says of the work done: processes claimed
    (claim), processes put back (recycle), dead workers found (reap_check),
    -1 for an error reply or a call that raised, 0 otherwise. Written as
    each call returns (a SIGKILL loses nothing)."""
    from mesh import _binding, _eval, _scripts

    names = {s.sha: n for n, s in _scripts.load_scripts().items()}
    f = open(path, "w")  # open for the life of the process
    run = _eval.run_script

    def amount(name: str, r: object) -> int:
        if not isinstance(r, list):
            return 0
        if name == "claim":
            return (len(r) - 3) // 4
        if name == "recycle" and r and r[0] == 0:
            return int(r[1])
        if name == "reap_check":
            return len(r) - 3
        return 0

    async def traced(conn: Any, script: Any, keys: Any, args: Any) -> Any:
        name = names.get(script.sha, "?")
        t = time.monotonic_ns()
        n = -1
        try:
            r = await run(conn, script, keys, args)
            n = amount(name, r)
            return r
        finally:
            f.write(f"{t} {time.monotonic_ns()} {name} {n}\n")
            f.flush()

    _eval.run_script = traced
    setattr(_binding, "run_script", traced)  # noqa: B010 (the name the binding imported)


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Stdin:
    """The parent's commands, a line each: trio's FdStream on trio, a worker
    thread's reads on asyncio (no command is timed)."""

    def __init__(self) -> None:
        fd = os.dup(sys.stdin.fileno())
        if sniffio.current_async_library() == "trio":
            self._read: Callable[[int], Awaitable[bytes]] = trio.lowlevel.FdStream(fd).receive_some
        else:
            self._read = anyio.wrap_file(os.fdopen(fd, "rb", buffering=0)).read
        self._buf = b""

    async def readline(self) -> str | None:
        while b"\n" not in self._buf:
            data = await self._read(4096)
            if not data:
                return None
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()


async def produce(args: argparse.Namespace) -> None:
    payloads = [b"%d" % i for i in range(args.n)]
    async with mesh.open_client(args.url, namespace=args.ns) as client:
        t = time.perf_counter()
        await client.enqueue_many(args.queue, payloads)
        out(f"enqueued {time.perf_counter() - t:.6f}")


async def throughput(args: argparse.Namespace) -> None:
    async def noop(process: mesh.Process) -> None:
        pass

    async def noop_batch(processes: list[mesh.Process]) -> None:
        pass

    stdin = Stdin()
    async with mesh.open_worker(args.url, namespace=args.ns, ttl=args.ttl) as worker:
        out("ready")
        if await stdin.readline() != "go":
            return
        if args.batch:
            await worker.start_work(
                args.queue, batch_handler=noop_batch, batch=args.batch, concurrency=args.concurrency
            )
        elif args.prefetch >= 0:
            await worker.start_work(
                args.queue, noop, concurrency=args.concurrency, prefetch=args.prefetch
            )
        else:
            await worker.start_work(args.queue, noop, concurrency=args.concurrency)
        out("started")
        await anyio.sleep_forever()


async def groups_work(args: argparse.Namespace) -> None:
    done: list[tuple[int, str | None]] = []

    async def noop(process: mesh.Process) -> None:
        done.append((time.monotonic_ns(), process.group))

    stdin = Stdin()
    async with mesh.open_worker(args.url, namespace=args.ns, ttl=args.ttl) as worker:
        out("ready")
        if await stdin.readline() != "go":
            return
        await worker.start_work(args.queue, noop, concurrency=args.concurrency)
        while (line := await stdin.readline()) is not None:
            if line == "dump":
                sys.stdout.write("".join(f"g {ns} {g or '-'}\n" for ns, g in done))
                out("end")


# KEYS[1] {ns}:queue:<Q> (trio-mesh's queue list), KEYS[2] {ns}:procs:<Q>
# ARGV[1] worker id, ARGV[2] how many to claim, ARGV[3..] payloads finished
# Returns: the payloads claimed (each noted as running: procs[payload] = W)
LOOP_LUA = """
if #ARGV > 2 then redis.call('HDEL', KEYS[2], unpack(ARGV, 3)) end
local got = redis.call('LPOP', KEYS[1], tonumber(ARGV[2]))
if not got then return {} end
local fields = {}
for i = 1, #got do fields[2 * i - 1] = got[i]; fields[2 * i] = ARGV[1] end
redis.call('HSET', KEYS[2], unpack(fields))
return got
"""


async def loop(args: argparse.Namespace) -> None:
    from mesh._connection import open_connection
    from mesh._keys import Keys

    k = Keys(args.ns)
    stdin = Stdin()
    async with open_connection(args.url) as conn:
        sha = (await conn.execute("SCRIPT", "LOAD", LOOP_LUA)).decode()
        head = (
            "EVALSHA",
            sha,
            2,
            k.queue(args.queue),
            k.procs(args.queue),
            "loop",
            args.concurrency,
        )
        out("ready")
        if await stdin.readline() != "go":
            return
        done: list[bytes] = []
        while True:
            done = await conn.execute(*head, *done)
            if not done:
                break
        out("drained")
        await anyio.sleep_forever()


async def failover(args: argparse.Namespace) -> None:
    async def device(process: mesh.Process) -> None:
        out(f"start {process.token} {time.monotonic_ns()}")
        await anyio.sleep_forever()

    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async with mesh.open_worker(args.url, namespace=args.ns, ttl=args.ttl) as worker:
            await worker.start_work("devices", device, concurrency=1)
            out(f"ready {worker.id}")
            async for _ in signals:
                break
        # leaving the block cancelled the handler and handed the task back


async def hold(args: argparse.Namespace) -> None:
    cancelled: list[tuple[bytes, int]] = []
    running = 0

    async def handler(process: mesh.Process) -> None:
        nonlocal running
        running += 1
        if args.notes:
            out(f"start {process.task.decode()} {time.monotonic_ns()}")
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.append((process.task, time.monotonic_ns()))
            raise
        finally:
            running -= 1

    ready = 0
    all_ready = anyio.Event()

    workers: list[mesh.Worker] = []
    # At most 50 workers starting at once: a thousand joining together would
    # hold the event loop long enough for the first leases (TTL 3 s) to run out.
    starting = anyio.Semaphore(50)

    async def one(i: int, fleet: mesh.Fleet | None) -> None:
        nonlocal ready
        opened = (
            fleet.open_worker()
            if fleet is not None
            else mesh.open_worker(args.url, namespace=args.ns, ttl=args.ttl)
        )
        await starting.acquire()
        started = False
        try:
            async with opened as worker:
                workers.append(worker)
                await worker.start_work(args.queue, handler, concurrency=args.concurrency)
                starting.release()
                started = True
                out(f"worker {worker.id}")
                ready += 1
                if ready == args.workers:
                    all_ready.set()
                await anyio.sleep_forever()
        finally:
            if not started:
                starting.release()

    async def serve(fleet: mesh.Fleet | None) -> None:
        stdin = Stdin()
        async with anyio.create_task_group() as nursery:
            for i in range(args.workers):
                nursery.start_soon(one, i, fleet)
            await all_ready.wait()
            if args.gc_freeze:
                gc.freeze()  # as `mesh worker` does once serving
            out("ready")
            while (line := await stdin.readline()) is not None:
                if line == "count":
                    out(f"count {running}")
                elif line == "beats":
                    out(f"beats {sum(w.statistics().heartbeats for w in workers)}")
                elif line == "dump":
                    for task, ns in cancelled:
                        out(f"cancelled {task.decode()} {ns}")
                    cancelled.clear()
                    out("end")
            nursery.cancel_scope.cancel()

    if args.fleet:
        async with mesh.open_fleet(
            args.url, namespace=args.ns, ttl=args.ttl, join_window=args.join_window
        ) as fleet:
            await serve(fleet)
    else:
        await serve(None)


async def latency_work(args: argparse.Namespace) -> None:
    started: list[tuple[int, bytes]] = []

    async def handler(process: mesh.Process) -> None:
        started.append((time.monotonic_ns(), process.task))

    stdin = Stdin()
    async with mesh.open_worker(args.url, namespace=args.ns, ttl=args.ttl) as worker:
        await worker.start_work(args.queue, handler, concurrency=args.concurrency)
        out("ready")
        while (line := await stdin.readline()) is not None:
            if line == "clock":
                out(f"clock {time.monotonic_ns()}")
            elif line == "count":
                out(f"count {len(started)}")
            elif line == "dump":
                for ns, task in started:
                    i, enqueued = task.split()
                    out(f"latency {int(i)} {ns - int(enqueued)}")
                out("end")


async def latency_produce(args: argparse.Namespace) -> None:
    stdin = Stdin()
    async with mesh.open_client(args.url, namespace=args.ns) as client:
        out("ready")
        if await stdin.readline() != "go":
            return
        start = anyio.current_time()
        first = last = 0
        for i in range(args.n):
            await anyio.sleep_until(start + i / args.rate)
            last = time.monotonic_ns()
            first = first or last
            await client.enqueue(args.queue, b"%d %d" % (i, last))
        out(f"enqueued {args.n} {first} {last}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "role",
        choices=[
            "produce", "throughput", "groups-work", "loop", "failover", "hold", "latency-work",
            "latency-produce",
        ],
    )  # fmt: skip
    parser.add_argument("--url", required=True)
    parser.add_argument("--fleet", action="store_true", help="hold: the workers as one fleet")
    parser.add_argument("--ns", required=True)
    parser.add_argument("--queue", default="bench")
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--rate", type=float, default=500.0, help="latency-produce: tasks/s")
    parser.add_argument(
        "--join-window", type=float, default=None, help="hold --fleet: open_fleet's join_window"
    )
    parser.add_argument(
        "--gc-threshold",
        type=int,
        default=0,
        help="gc.set_threshold(700, 10, N): a full collection every N gen1 ones",
    )
    parser.add_argument(
        "--notes", action="store_true", help="hold: print start <payload> <ns> per handler start"
    )
    parser.add_argument("--gc-freeze", action="store_true", help="hold: gc.freeze() once serving")
    parser.add_argument("--batch", type=int, default=0, help="throughput: a batch handler")
    parser.add_argument(
        "--prefetch", type=int, default=-1, help="throughput: prefetch (-1: the default)"
    )
    parser.add_argument(
        "--loop",
        default="trio",
        choices=RUNNERS,
        help="the event loop of this child (its worker and handlers)",
    )
    args = parser.parse_args()
    roles = {
        "produce": produce,
        "throughput": throughput,
        "groups-work": groups_work,
        "loop": loop,
        "failover": failover,
        "hold": hold,
        "latency-work": latency_work,
        "latency-produce": latency_produce,
    }
    role = roles[args.role]
    if args.gc_threshold:
        gc.set_threshold(700, 10, args.gc_threshold)
    trace = os.environ.get("MESH_BENCH_TRACE")
    if trace:
        trace_scripts(f"{trace}/calls-{os.getpid()}.txt")
    stalls = os.environ.get("MESH_BENCH_STALLS")
    instruments = [Stalls(f"{stalls}/stalls-{os.getpid()}.txt")] if stalls else []
    try:
        if args.loop == "trio" and instruments:
            trio.run(role, args, instruments=instruments)
        else:
            run(args.loop, role, args)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
