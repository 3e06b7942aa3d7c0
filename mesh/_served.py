"""The queues a worker serves, and their runners.

:class:`Served` keeps a worker's queue configurations and starts one
:class:`~mesh._runner.QueueRunner` per queue served with a handler in each
generation of its lease (:mod:`mesh._lease`), again after every rejoin. It
registers a queue with Redis (``serve``) and adopts the queue's stored
policy when the queue is started, applies a policy its host read later,
stops a queue (its handlers cancelled, each process handed back once its
handler exited, the rest drained in the background after the grace), and
routes a cancel to the runner that holds the process.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio

from ._errors import CommandError, ConfigError, FencedError, MeshConnectionError
from ._host import Host
from ._lease import Generation, Lease
from ._policy import QueuePolicy, differences, parse_policy, policy_fields
from ._queue_config import QueueConfig
from ._runner import QueueRunner
from ._stats import Recorder
from ._types import Process

__all__ = ["Served"]

log = logging.getLogger("mesh.worker")


class Served:
    """The queues one worker serves (see the module's docstring)."""

    def __init__(self, host: Host, lease: Lease, recorder: Recorder) -> None:
        self._conn = host.conn
        self._binding = host.binding
        self._timing = host.timing
        self._min_replicas = host.min_replicas
        self._lease = lease
        self._stats = recorder
        self.configs: dict[str, QueueConfig] = {}
        """The queues served now, by name (a policy read later replaces one)."""
        self._lock = anyio.Lock()

    def capacity(self, queue: str) -> int:
        """The worker's capacity on ``queue`` (1 if not served)."""
        cfg = self.configs.get(queue)
        return cfg.capacity if cfg is not None else 1

    async def start(self, cfg: QueueConfig, local: QueuePolicy, explicit: dict[str, Any]) -> None:
        """Serve ``cfg.queue`` (see :meth:`Worker.start_work`): register it,
        adopt its stored policy (``local`` stored first if it has none;
        ``explicit``: the options given, to warn about) and start its runner.

        Raises:
            ConfigError: served already, or still stopping.
            FencedError, MeshConnectionError: as from Redis; the queue is
                then not served (on cancellation too).
        """
        queue = cfg.queue
        async with self._lock:
            if queue in self.configs:
                raise ConfigError(f"queue {queue!r} is served already; stop_work() it first")
            if queue in self._lease.gen.draining:
                raise ConfigError(
                    f"queue {queue!r} is still stopping: handlers that outlived the stop "
                    "grace still run"
                )
            self.configs[queue] = cfg
            try:
                gen = await self._lease.current()
                try:
                    await self._binding.serve(
                        self._conn, gen.id, gen.incarnation, queue, cfg.capacity
                    )
                    policy = await self._adopt_policy(gen.id, queue, local, explicit)
                    cfg = self.configs[queue] = cfg.with_policy(policy)
                    await self._start_runner(gen, cfg)
                except (FencedError, RuntimeError) as exc:
                    # RuntimeError: the generation's nursery closed under us
                    # (it ended: fenced, or stopping).
                    fenced = gen.scope.cancel_called or gen is not self._lease.gen
                    if self._lease.closing or (isinstance(exc, FencedError) and not fenced):
                        raise
                    # This identity was fenced meanwhile: the next one serves
                    # the queue (it is in self.configs) and starts its runner.
                    await self._lease.current()
            except BaseException:
                del self.configs[queue]
                raise

    async def stop(self, queue: str, grace: float) -> int:
        """Stop serving ``queue`` (see :meth:`Worker.stop_work`); handlers
        still running after ``grace`` are drained in the background.

        Returns:
            How many processes were handed back by the time it returns.
        Raises:
            ConfigError: the queue is not served.
            MeshConnectionError: Redis could not be reached.
        """
        async with self._lock:
            if queue not in self.configs:
                raise ConfigError(f"queue {queue!r} is not served by this worker")
            del self.configs[queue]
            gen = self._lease.gen
            runner = gen.runners.pop(queue, None)
            if runner is not None and not await runner.stop(grace):
                left = runner.stopping_slots()
                log.warning(
                    "queue %s: %d handlers still run %g s after stop_work(); their processes "
                    "are handed back as they exit",
                    queue,
                    len(left),
                    grace,
                )
                gen.draining[queue] = runner
                if gen.nursery is not None:
                    gen.nursery.start_soon(self._finish_draining, gen, queue, runner)
                return runner.handed_back
            back = await self._binding.unserve(self._conn, gen.id, queue)
            return back + (runner.handed_back if runner is not None else 0)

    async def _finish_draining(self, gen: Generation, queue: str, runner: QueueRunner) -> None:
        """Unserve ``queue`` once the handlers that outlived stop_work()'s
        grace have exited (retried until Redis answers)."""
        await runner.wait_exited()
        backoff = 0.05
        while True:
            try:
                await self._binding.unserve(self._conn, gen.id, queue)
                break
            except (MeshConnectionError, CommandError) as exc:
                log.debug("queue %s: could not unserve yet: %s", queue, exc)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
        gen.draining.pop(queue, None)

    def runners(self) -> list[QueueRunner]:
        """The current generation's runners, those still draining included."""
        gen = self._lease.gen
        return [*gen.runners.values(), *gen.draining.values()]

    def running(self) -> list[tuple[Process, float]]:
        """The processes whose handlers run now, with how long each has run."""
        now = anyio.current_time()
        return [(p, now - started) for r in self.runners() for p, started in r.stopping_slots()]

    async def start_runners(self, gen: Generation) -> None:
        """Start a runner for every queue served with a handler, in ``gen``."""
        for cfg in list(self.configs.values()):
            await self._start_runner(gen, cfg)

    async def _start_runner(self, gen: Generation, cfg: QueueConfig) -> None:
        if cfg.handler is None or gen.nursery is None:
            return
        runner = QueueRunner(
            self._conn,
            self._binding,
            gen.id,
            gen.incarnation,
            cfg,
            self._stats.queue(cfg.queue),
            gen.fence,
            balance_wait=self._timing.interval,
            ttl=self._timing.ttl,
            early_cancels=gen.early_cancels,
            replicate=self._replicate if self._min_replicas else None,
        )
        gen.runners[cfg.queue] = runner
        await gen.nursery.start(runner.run)

    async def _adopt_policy(
        self, wid: str, queue: str, local: QueuePolicy, explicit: dict[str, Any]
    ) -> QueuePolicy:
        """The queue's stored policy; ``local`` (the start_work options) is
        stored first if the queue has none. Options given explicitly that the
        stored policy overrides are reported (a warning), not mixed in."""
        fields = policy_fields(
            max_attempts=local.max_attempts, backoff=local.backoff, backoff_max=local.backoff_max
        )
        raw = await self._binding.configure(self._conn, queue, "default", f"worker {wid}", fields)
        assert raw is not None
        policy = parse_policy(raw, queue)
        diff = differences(policy, explicit)
        if diff:
            log.warning(
                "queue %s: start_work options %s are overridden by the queue's policy (set by %s)",
                queue,
                ", ".join(diff),
                policy.source or "configure",
            )
        return policy

    def apply_policy(self, queue: str, policy: QueuePolicy) -> None:
        """A policy read from Redis: the runner of ``queue`` uses it from now on."""
        cfg = self.configs.get(queue)
        if cfg is None:
            return
        new = cfg.with_policy(policy)
        if new == cfg:
            return
        self.configs[queue] = new
        runner = self._lease.gen.runners.get(queue)
        if runner is not None:
            runner.config = new
        log.info("queue %s: applying the queue's policy %s", queue, policy)

    async def _replicate(self) -> None:
        """With ``min_replicas``: wait (up to R) until that many replicas have
        every write made so far; MeshConnectionError if they do not."""
        await self._conn.wait_replicas(self._min_replicas, self._timing.fence_after)

    def cancel_process(self, pid: str) -> None:
        """A cancel of process ``pid``: to the runner that holds it, else kept
        as an early cancel (a claim reply may be on its way). Sync."""
        gen = self._lease.gen
        for runner in gen.runners.values():
            if runner.cancel_process(pid):
                return
        gen.early_cancels[pid] = anyio.current_time()

    # --- queues served by hand (no handler) ------------------------------------

    async def claim_one(self, queue: str) -> Process | None:
        """Claim the next task of ``queue``, served without a handler (see
        :meth:`Worker.dequeue`).

        Raises:
            ConfigError: not served, or served by a handler.
            FencedError, MeshConnectionError: as from Redis."""
        cfg = self.configs.get(queue)
        if cfg is None:
            raise ConfigError(
                f"queue {queue!r} is not served by this worker; start_work() it first"
            )
        if cfg.handler is not None:
            raise ConfigError(
                f"queue {queue!r} is served by a handler; dequeue() is for queues without one"
            )
        gen = await self._lease.current()
        reply = await self._binding.claim(
            self._conn,
            gen.id,
            gen.incarnation,
            queue,
            1,
            cfg.max_attempts,
            backoff_ms=int(cfg.backoff * 1000),
            backoff_cap_ms=int(cfg.backoff_max * 1000),
            ttl_ms=int(self._timing.ttl * 1000),
            wake=False,
            rate=cfg.rate,
        )
        return reply.processes[0] if reply.processes else None

    async def finish(self, process: Process) -> bool:
        """Report ``process`` finished (see :meth:`Worker.finish`)."""
        gen = self._lease.gen
        incarnation = gen.incarnation if process.worker_id == gen.id else ""
        r = await self._binding.finish(
            self._conn, process.worker_id, incarnation, process.queue, [process.id]
        )
        return r[0]

    async def give_back(self, process: Process, failed: bool, error: str | None) -> bool:
        """Hand ``process`` back (see :meth:`Worker.give_back`)."""
        cfg = self.configs.get(process.queue)
        backoff, cap = (cfg.backoff, cfg.backoff_max) if cfg else (1.0, 60.0)
        r = await self._binding.give_back(
            self._conn,
            process.worker_id,
            process.queue,
            [process.id],
            failed=failed,
            backoff_ms=int(backoff * 1000),
            backoff_cap_ms=int(cap * 1000),
            errors=[error] if failed and error else None,  # cut by the binding
        )
        return r[0][0] != 0
