"""``mesh worker APP``: run a peer that serves the queues of an app.

APP is ``module:attribute`` naming a mapping ``{queue name: handler}``, where a
handler is ``async def handler(process: mesh.Process)``, or
``mesh.Batched(batch_handler, size)`` for a batch handler
(``async def batch_handler(processes: list[mesh.Process])``, see
:meth:`mesh.Worker.start_work`). The current directory
is put on ``sys.path`` first, as uvicorn and arq do, so ``mesh worker
tasks:queues`` finds ``./tasks.py``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

import mesh
from mesh import LeaseTiming
from mesh._keys import check_queue, check_worker_id
from mesh._loop import RUNNERS
from mesh._pool import MOVED
from mesh._queue_config import check_handler

from . import _metrics
from ._common import (
    CliError,
    Target,
    UsageError,
    add_target_options,
    count_arg,
    run_on,
    seconds_arg,
    show_task,
    target,
)
from ._tasks import weight_arg

__all__ = ["AppImportError", "load_app", "register"]

log = logging.getLogger("mesh.cli")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``worker`` to the ``mesh`` parser."""
    p = sub.add_parser(
        "worker",
        help="run a worker (a peer) that serves the queues of an app",
        description="Run a worker that serves every queue of APP, a 'module:attribute' "
        "naming a mapping {queue: handler}, e.g. 'tasks:queues' for a dict 'queues' in "
        "./tasks.py. SIGINT or SIGTERM cancels every handler and hands each process back "
        "once its handler has exited (peers take over at once, never while the old handler "
        "still runs; no attempt is counted), then exits 0. A second signal prints what the "
        "stop is waiting for. Handlers still running after --stop-grace: the worker exits 1 "
        "and peers take their tasks over after the TTL, as after a crash.",
    )
    p.add_argument("app", metavar="APP", help="module:attribute, a mapping {queue: handler}")
    add_target_options(p)
    _capacity_options(p)
    _retry_options(p)
    _lease_options(p)
    _run_options(p)
    _metrics.add_worker_options(p)
    p.set_defaults(func=_worker)


def _capacity_options(p: argparse.ArgumentParser) -> None:
    """How much the worker runs: concurrency, capacity and prefetch, per queue."""
    p.add_argument(
        "--concurrency",
        "-c",
        action="append",
        default=[],
        type=_concurrency_arg,
        metavar="[Q=]N",
        help="processes at once: 'Q=N' for queue Q, a bare 'N' for every other queue "
        "(repeatable; default 10)",
    )
    p.add_argument(
        "--queue-concurrency",
        "-q",
        dest="concurrency",
        action="append",
        type=_queue_concurrency_arg,
        metavar="Q=N",
        help="the same as --concurrency Q=N",
    )
    p.add_argument(
        "--capacity",
        action="append",
        default=[],
        type=_capacity_arg,
        metavar="[Q=]N",
        help="this worker's part of the fair share of persistent tasks, against the other "
        "workers' (1 to 1,000,000): 'Q=N' for queue Q, a bare 'N' for every other queue "
        "(repeatable; default 1). A worker of capacity 2 is given twice the weight of one "
        "of capacity 1",
    )
    p.add_argument(
        "--prefetch",
        action="append",
        default=[],
        type=_prefetch_arg,
        metavar="[Q=]N",
        help="processes to claim beyond the concurrency, held here until a slot frees, so "
        "that a freed slot starts the next one without a round trip to Redis: 'Q=N' for "
        "queue Q, a bare 'N' for every other queue (repeatable; 0: none). By default it "
        "adapts: up to the concurrency while handlers are short and the queue has a "
        "backlog, none otherwise. Plain handlers only; see Worker.start_work",
    )


def _retry_options(p: argparse.ArgumentParser) -> None:
    """The queue's policy when Redis has none: attempts and backoff."""
    p.add_argument(
        "--max-attempts",
        type=count_arg("max_attempts"),
        default=None,
        metavar="N",
        help="attempts of a one-shot task before it is dead-lettered (0: no limit; default 5). "
        "This and the backoff are the queue's policy only if it has none in Redis "
        "(see 'mesh configure')",
    )
    p.add_argument(
        "--backoff",
        type=seconds_arg("backoff"),
        default=None,
        metavar="S",
        help="delay before the first retry of a failed task, doubling after (default 1)",
    )
    p.add_argument(
        "--backoff-max",
        type=seconds_arg("backoff_max"),
        default=None,
        metavar="S",
        help="longest retry delay (60)",
    )


def _lease_options(p: argparse.ArgumentParser) -> None:
    """The lease and the stop: TTL, stop grace, worker id, sticky restarts."""
    p.add_argument(
        "--ttl",
        type=_ttl_arg,
        default=3.0,
        metavar="S",
        help="lease TTL in seconds: how long after a crash peers take over (default 3)",
    )
    p.add_argument(
        "--stop-grace",
        type=seconds_arg("stop_grace"),
        default=10.0,
        metavar="S",
        help="on SIGINT/SIGTERM, how long to wait for cancelled handlers to exit (a "
        "cleanup) while still holding their tasks (default 10)",
    )
    p.add_argument("--worker-id", metavar="ID", help="worker id (default: <host>-<pid>-<random>)")
    p.add_argument(
        "--rejoin-grace",
        type=seconds_arg("rejoin_grace"),
        default=0.0,
        metavar="S",
        help="a sticky restart: on SIGINT/SIGTERM keep this worker's persistent tasks for "
        "--worker-id for S seconds; restarted with the same id within them, it gets them "
        "back (default 0: off; needs --worker-id)",
    )


def _run_options(p: argparse.ArgumentParser) -> None:
    """How the worker runs: logs, tracebacks and the event loop."""
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default info); logs go to stderr, one line per event",
    )
    p.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="'text' (default): one line per event; 'json': one JSON object per line, "
        "for log shippers (keys time, level, logger, message; traceback at debug)",
    )
    p.add_argument(
        "--traceback",
        action="store_true",
        help="if APP's module fails to import, print the traceback (default: one line)",
    )
    p.add_argument(
        "--loop",
        default="trio",
        choices=RUNNERS,
        help="the event loop that runs the worker and its handlers (default trio): "
        "handlers are coroutine functions of that loop; 'uvloop' is asyncio on uvloop "
        "(installed separately)",
    )


_count_arg = count_arg("concurrency", 1)
_prefetch_count = count_arg("prefetch")


def _ttl_arg(text: str) -> float:
    """``--ttl``: seconds that make a lease timing (see
    :meth:`LeaseTiming.make`), else a usage error naming the rule."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    try:
        LeaseTiming.make(v, None, None)
    except mesh.ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return v


def _queue_and_count(text: str, count: Callable[[str], int]) -> tuple[str | None, int]:
    """Parse ``N`` or ``QUEUE=N``: the queue (None for a bare ``N``: every
    other queue) and ``count(N)``. Raises ArgumentTypeError naming what was
    wrong."""
    queue, eq, n = text.rpartition("=")
    if not eq:
        return None, count(text)
    if not queue:
        raise argparse.ArgumentTypeError(f"expected N or QUEUE=N, not {text!r}")
    try:
        check_queue(queue)
    except mesh.ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return queue, count(n)


def _concurrency_arg(text: str) -> tuple[str | None, int]:
    return _queue_and_count(text, _count_arg)


def _capacity_arg(text: str) -> tuple[str | None, int]:
    return _queue_and_count(text, weight_arg)


def _prefetch_arg(text: str) -> tuple[str | None, int]:
    return _queue_and_count(text, _prefetch_count)


def _queue_concurrency_arg(text: str) -> tuple[str | None, int]:
    queue, n = _concurrency_arg(text)
    if queue is None:
        raise argparse.ArgumentTypeError(f"expected QUEUE=N, not {text!r}")
    return queue, n


def _per_queue(
    given: list[tuple[str | None, int]],
    app: dict[str, mesh.Handler | mesh.Batched],
    default: int,
    option: str,
) -> dict[str, int]:
    """``[Q=]N`` options as a value per queue of ``app`` (a bare N: the default)."""
    for queue, n in given:
        if queue is None:
            default = n
    per_queue = {q: n for q, n in given if q is not None}
    unknown = sorted(set(per_queue) - set(app))
    if unknown:
        raise UsageError(f"{option} names queues that APP does not serve: {unknown}")
    return {q: per_queue.get(q, default) for q in app}


class AppImportError(CliError):
    """APP's module raised while it was imported (a bug there): exit status 1.
    The exception is the ``__cause__``; ``--traceback`` prints it."""


def load_app(spec: str) -> dict[str, mesh.Handler | mesh.Batched]:
    """Import ``module:attribute`` and check that it maps queue names to handlers.

    The current directory goes first on ``sys.path`` (as with uvicorn).

    Raises:
        UsageError: a malformed spec (a file path is refused with the module
            name to use instead), no such module or attribute, or not a
            mapping of valid queue names to async callables.
        AppImportError: importing the module raised (its ``__cause__``).
    """
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise UsageError(f"APP must be 'module:attribute', e.g. 'tasks:queues'; got {spec!r}")
    if module_name.endswith(".py") or module_name.startswith(".") or "/" in module_name:
        path = Path(module_name)
        stem = path.name.removesuffix(".py").strip(".") or "tasks"
        where = "the current directory" if path.parent == Path(".") else str(path.parent)
        raise UsageError(
            f"APP names a module, not a file: drop '.py' (and any path): "
            f"'{stem}:{attr}', run from {where} (or with it on PYTHONPATH)"
        )
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only the named module (or a parent package) missing is a usage error;
        # an import that fails inside it is a bug to show with its traceback.
        if exc.name and (module_name + ".").startswith(exc.name + "."):
            raise UsageError(
                f"cannot import {module_name!r} (from APP {spec!r}): no such module "
                f"in {cwd} or on sys.path"
            ) from None
        raise _import_failed(module_name, exc) from exc
    except Exception as exc:
        raise _import_failed(module_name, exc) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, Mapping):
        raise UsageError(
            f"APP {spec!r} is a {type(obj).__name__}, not a mapping {{queue name: handler}}"
        )
    if not obj:
        raise UsageError(f"APP {spec!r} maps no queue")
    app: dict[str, mesh.Handler | mesh.Batched] = {}
    for queue, handler in obj.items():
        try:
            check_queue(queue)
        except (TypeError, mesh.ConfigError) as exc:
            raise UsageError(f"APP {spec!r}: {exc}") from None
        try:
            if not isinstance(handler, mesh.Batched):
                check_handler(handler)
        except TypeError as exc:
            raise UsageError(f"APP {spec!r}, queue {queue!r}: {exc}") from None
        app[queue] = handler
    return app


def _import_failed(module: str, exc: BaseException) -> AppImportError:
    where = ""
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        where = f" at {tb[-1].filename}:{tb[-1].lineno}"
    elif isinstance(exc, SyntaxError) and exc.filename:
        where = f" at {exc.filename}:{exc.lineno}"
    return AppImportError(f"importing {module!r} failed{where}: {type(exc).__name__}: {exc}")


def _worker(args: argparse.Namespace) -> int:
    t = target(args)
    try:
        app = load_app(args.app)
    except AppImportError as exc:
        if args.traceback and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__)
            raise
        # the hint only where it helps: not after the traceback was printed
        raise AppImportError(f"{exc} (run with --traceback to see the traceback)") from None
    default = 10
    for queue, n in args.concurrency:
        if queue is None:
            default = n
    per_queue = {q: n for q, n in args.concurrency if q is not None}
    unknown = sorted(set(per_queue) - set(app))
    if unknown:
        raise UsageError(f"--concurrency names queues that APP does not serve: {unknown}")
    concurrency = {q: per_queue.get(q, default) for q in app}
    capacity = _per_queue(args.capacity, app, 1, "--capacity")
    prefetch = _per_queue(args.prefetch, app, -1, "--prefetch")  # -1: not given
    batched = sorted(q for q, _ in args.prefetch if q and isinstance(app.get(q), mesh.Batched))
    if batched:
        raise UsageError(f"--prefetch is for plain handlers; these queues are batched: {batched}")
    # a bare N applies to the queues with plain handlers; a queue not named
    # adapts (start_work's default)
    prefetch = {
        q: 0 if isinstance(app[q], mesh.Batched) else n for q, n in prefetch.items() if n >= 0
    }
    try:
        LeaseTiming.make(args.ttl, None, None)
        if args.worker_id is not None:
            check_worker_id(args.worker_id)
    except mesh.ConfigError as exc:
        raise UsageError(str(exc)) from None
    if args.rejoin_grace > 0 and args.worker_id is None:
        raise UsageError("--rejoin-grace needs --worker-id: the id the worker rejoins as")
    backoff = 1.0 if args.backoff is None else args.backoff
    backoff_max = 60.0 if args.backoff_max is None else args.backoff_max
    if not 0 <= backoff <= backoff_max:
        raise UsageError("need 0 <= --backoff <= --backoff-max")
    _metrics.check_worker_options(args)
    handler = logging.StreamHandler(sys.stderr)
    if args.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    return run_on(args.loop, _serve, args, t, app, concurrency, capacity, prefetch)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (UTC, ISO 8601 with
    milliseconds), ``level``, ``logger``, ``message``, and ``traceback`` when
    the record carries one (only DEBUG records do)."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class _Stopping:
    """How the worker stops on SIGINT or SIGTERM. ``now`` is set once it is
    stopping (so cancelled handlers are logged as stopped for a hand-back, not
    as cancelled). The first signal leaves the worker's block, where it hands
    everything back (before the worker started: cancels the start); a second
    says what the stop waits for; ``grace`` seconds after the first, the
    process exits (see :meth:`deadline`)."""

    def __init__(self, grace: float) -> None:
        self.now = False
        self.started = False
        self.worker: mesh.Worker | None = None
        self.requested = anyio.Event()
        self._grace = grace

    async def on_signals(self, signals: AsyncIterator[int], group: anyio.abc.TaskGroup) -> None:
        """Act on each signal of ``signals``; ``group`` runs the worker."""
        async for signum in signals:
            name = signal.Signals(signum).name
            if self.now:
                # A second signal: say what the stop waits for.
                if self.worker is not None:
                    log.warning("%s received: %s", name, _waiting_for(self.worker))
                continue
            self.now = True
            if self.started:
                log.info("%s received: stopping", name)
                self.requested.set()  # leave the worker's block: it hands everything back
                group.start_soon(self.deadline)
            else:
                log.info("%s received while starting: stopping", name)
                group.cancel_scope.cancel()
                return

    async def deadline(self) -> None:
        """The worker stops renewing its lease at the grace; a handler that
        ignores its cancellation still holds up leaving the block. Exit then:
        the lease runs out within the TTL and peers take those tasks over, as
        after a crash."""
        await anyio.sleep(self._grace + 0.5)
        worker = self.worker
        assert worker is not None
        log.error(
            "worker %s: handlers still running %g s after the stop began; exiting. "
            "%s. Peers take their tasks over when the lease runs out.",
            worker.id,
            self._grace,
            _waiting_for(worker),
        )
        logging.shutdown()
        os._exit(1)


def _logged_batch(handler: mesh.BatchHandler, stopping: _Stopping) -> mesh.BatchHandler:
    async def run(ps: list[mesh.Process]) -> Any:
        what = f"{ps[0].queue} batch of {len(ps)}"
        log.info("start %s", what)
        t0 = time.monotonic()
        try:
            result = await handler(ps)
        except anyio.get_cancelled_exc_class() as exc:
            how = (
                "stopped"
                if stopping.now
                else "moved"
                if mesh.cancel_reason(exc) == MOVED
                else "cancelled"
            )
            log.info("%s %s after %.0f ms", how, what, (time.monotonic() - t0) * 1000)
            raise
        log.info("finish %s in %.0f ms", what, (time.monotonic() - t0) * 1000)
        return result

    return run


def _logged(handler: mesh.Handler, stopping: _Stopping) -> mesh.Handler:
    async def run(p: mesh.Process) -> Any:
        what = f"{p.queue} {show_task(p.task)!r} token {p.token}"
        log.info(
            "start %s%s%s",
            what,
            " (persistent)" if p.persistent else "",
            f" attempt {p.attempts + 1}" if p.attempts else "",
        )
        t0 = time.monotonic()
        try:
            result = await handler(p)
        except anyio.get_cancelled_exc_class() as exc:
            if stopping.now:
                # The hand-back itself follows, by the worker, now that the
                # handler has exited.
                log.info(
                    "stopped %s after %.0f ms; handing it back",
                    what,
                    (time.monotonic() - t0) * 1000,
                )
            elif mesh.cancel_reason(exc) == MOVED:
                log.info(
                    "moved %s after %.0f ms; handing it back for a peer below its fair share",
                    what,
                    (time.monotonic() - t0) * 1000,
                )
            else:
                log.info("cancelled %s after %.0f ms", what, (time.monotonic() - t0) * 1000)
            raise
        log.info("finish %s in %.0f ms", what, (time.monotonic() - t0) * 1000)
        return result

    return run


def _waiting_for(worker: mesh.Worker) -> str:
    """What a stop is waiting for, on one line."""
    running = worker.running()
    left = worker.stop_time_left()
    shown = ", ".join(
        f"{p.queue} {show_task(p.task)!r} token {p.token} ({age:.1f} s)" for p, age in running[:10]
    )
    more = f" and {len(running) - 10} more" if len(running) > 10 else ""
    grace = "" if left is None else f"; at most {left:.1f} s left of the stop grace"
    if not running:
        return "stopping: every handler has exited; handing back" + grace
    return f"stopping: waiting for {len(running)} handlers to exit: {shown}{more}{grace}"


async def _serve(
    args: argparse.Namespace,
    t: Target,
    app: dict[str, mesh.Handler | mesh.Batched],
    concurrency: dict[str, int],
    capacity: dict[str, int] | None = None,
    prefetch: dict[str, int] | None = None,
) -> int:
    stopping = _Stopping(args.stop_grace)
    # Catch the signals first: one that arrives while we start still stops us
    # cleanly instead of killing the process with processes held.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as nursery:
            nursery.start_soon(stopping.on_signals, signals, nursery)
            async with (
                mesh.open_worker(
                    t.config,
                    namespace=t.namespace,
                    ttl=args.ttl,
                    worker_id=args.worker_id,
                    stop_grace=args.stop_grace,
                    rejoin_grace=args.rejoin_grace,
                ) as worker,
                _metrics.serve_worker_metrics(worker, args),
            ):
                stopping.worker = worker
                await _start_app(worker, args, app, stopping, concurrency, capacity, prefetch)
                stopping.started = True
                # The app, the mesh and the connection are loaded: what lives
                # now lives as long as the process. Freezing it keeps the
                # collector from scanning it again in every full collection
                # (one took 15-19 ms in a fresh worker, in the middle of taking
                # over 1,000 tasks, when the new handlers set it off).
                gc.freeze()
                log.info(
                    "worker %s serves %s on %s namespace %s (ttl %gs, stop grace %gs, pid %d)",
                    worker.id,
                    ", ".join(f"{q}[{n}]" for q, n in concurrency.items()),
                    t.shown,
                    t.namespace,
                    args.ttl,
                    args.stop_grace,
                    os.getpid(),
                )
                await stopping.requested.wait()
                s = worker.statistics()
                log.info(
                    "worker %s stopping: cancelling %d running handlers, each handed back once "
                    "it exited (%d started, %d finished, %d failed, %d cancelled)",
                    worker.id,
                    s.running,
                    s.processes_started,
                    s.processes_finished,
                    s.processes_failed,
                    s.processes_cancelled,
                )
            s = worker.statistics()
            log.info("worker %s handed back %d processes", worker.id, s.processes_handed_back)
            nursery.cancel_scope.cancel()
    log.info("worker stopped")
    return 0


async def _start_app(
    worker: mesh.Worker,
    args: argparse.Namespace,
    app: dict[str, mesh.Handler | mesh.Batched],
    stopping: _Stopping,
    concurrency: dict[str, int],
    capacity: dict[str, int] | None,
    prefetch: dict[str, int] | None,
) -> None:
    """Serve every queue of ``app`` with its handler, logged."""
    retry = {
        "max_attempts": args.max_attempts,
        "backoff": args.backoff,
        "backoff_max": args.backoff_max,
    }
    for queue, handler in app.items():
        if isinstance(handler, mesh.Batched):
            await worker.start_work(
                queue,
                batch_handler=_logged_batch(handler.handler, stopping),
                batch=handler.size,
                concurrency=max(concurrency[queue], handler.size),
                capacity=(capacity or {}).get(queue, 1),
                **retry,
            )
            continue
        await worker.start_work(
            queue,
            _logged(handler, stopping),
            concurrency=concurrency[queue],
            capacity=(capacity or {}).get(queue, 1),
            prefetch=(prefetch or {}).get(queue),
            **retry,
        )
