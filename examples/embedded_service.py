"""A service that embeds a worker and reconciles its desired connections.

The service keeps one connection open per name in a desired set that lives in
its configuration. It runs as two replicas. Each replica embeds a worker in
its own nursery (``open_worker`` inside the service's ``run``), serves the
queue ``connections`` with a handler that holds one connection for as long
as it runs, and every ``period`` seconds calls ``client.reconcile`` with the
desired set: missing names become persistent tasks, names no longer wanted
are cancelled wherever they run. Both replicas reconcile; that is safe,
because ``reconcile`` only changes what differs.

The run changes the configuration a few times and shows the adds and the
cancels, then stops one replica as a deployment would: leaving
``open_worker`` hands its connections back, and the other replica takes them
over at once, without waiting for a lease to run out. Run it::

    python examples/embedded_service.py         # embedded redis-server
    MESH_REDIS_URL=redis://host:port python examples/embedded_service.py
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Callable, Iterable

import _support
import attrs
import trio

import mesh

QUEUE = "connections"
STEPS = [
    ["db-primary", "cache", "metrics"],
    ["db-primary", "cache", "search"],
]


class ConnectionService:
    """One replica of a service that holds the connections named by
    ``desired()``, spread over all replicas, each held by exactly one.

    Args:
        url, namespace: the mesh.
        name: a name for this replica (used in its worker id and its output).
        desired: returns the names that should be connected; read at every
            reconcile.
        period: seconds between two reconciles.
        say: where to print.
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        name: str,
        desired: Callable[[], Iterable[str]],
        *,
        period: float = 0.2,
        say: Callable[[str], None] = print,
    ) -> None:
        self.name = name
        self.open: dict[str, int] = {}
        """The connections this replica holds now: name -> fencing token."""
        self.reconciled: list[mesh.ReconcileResult] = []
        """Every reconcile of this replica that changed something."""
        self._url = url
        self._namespace = namespace
        self._desired = desired
        self._period = period
        self._say = say
        self._scope = trio.CancelScope()
        self._stopped = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join the mesh, serve, reconcile every ``period``, until :meth:`stop`
        or cancellation. Leaving hands every connection back to the mesh."""
        try:
            with self._scope:
                wid = f"{self.name}-{secrets.token_hex(2)}"
                async with mesh.open_worker(
                    self._url, namespace=self._namespace, worker_id=wid
                ) as worker:
                    await worker.start_work(QUEUE, self._hold, concurrency=100)
                    task_status.started()
                    while True:
                        want = sorted(self._desired())
                        result = await worker.client.reconcile(QUEUE, want)
                        if result.added or result.cancelled:
                            self.reconciled.append(result)
                            self._say(
                                f"{self.name}: reconcile {want} -> added "
                                f"{_names(result.added)}, cancelled {_names(result.cancelled)}"
                            )
                        await trio.sleep(self._period)
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """Stop this replica and wait until it has left the mesh."""
        self._scope.cancel()
        await self._stopped.wait()

    async def _hold(self, process: mesh.Process) -> None:
        """Hold one connection until the mesh cancels it or the replica stops."""
        name = process.task.decode()
        self.open[name] = process.token
        self._say(f"{self.name}: opened {name} (token {process.token})")
        try:
            await trio.sleep_forever()  # a real service would use the connection here
        finally:
            del self.open[name]
            self._say(f"{self.name}: closed {name}")


def _names(payloads: Iterable[bytes]) -> list[str]:
    return [p.decode() for p in payloads]


@attrs.frozen
class Report:
    """What the run saw.

    Attributes:
        holders: after each step, which replica held each connection.
        reconciled: every reconcile that changed something, as
            ``(replica, added, cancelled)``.
        stopped: the replica that was stopped.
        handover: seconds from stopping it until the other held all of its
            connections.
    """

    holders: list[dict[str, str]]
    reconciled: list[tuple[str, list[str], list[str]]]
    stopped: str
    handover: float


async def run(
    url: str,
    *,
    namespace: str = "example-service",
    say: Callable[[str], None] | None = None,
) -> Report:
    """Run the scenario of the module docstring against Redis at ``url``.

    Raises:
        TimeoutError: the connections did not converge in time.
    """
    narrate = _support.Narrator(say)
    desired: list[str] = []
    replicas = [
        ConnectionService(url, namespace, f"replica-{i}", lambda: desired, say=narrate)
        for i in (1, 2)
    ]
    holders: list[dict[str, str]] = []

    def held() -> dict[str, str]:
        out: dict[str, str] = {}
        for r in replicas:
            for c in r.open:
                out[c] = out.get(c, "") + ("+" if c in out else "") + r.name
        return dict(sorted(out.items()))

    async def converged() -> bool:
        h = held()
        return sorted(h) == sorted(desired) and all("+" not in v for v in h.values())

    async with mesh.open_client(url, namespace=namespace) as client, trio.open_nursery() as nursery:
        await client.delete_queue(QUEUE)  # whatever an earlier run left behind
        for r in replicas:
            await nursery.start(r.run)
        narrate("2 replicas up, each embedding a worker; desired connections: []")

        for step in STEPS:
            desired[:] = step
            narrate(f"configuration changed: desired connections {step}")
            await _support.wait_until(converged, within=10, what=f"the connections {step}")
            holders.append(held())
            narrate(f"held: {holders[-1]}")

        leaving = max(replicas, key=lambda r: (len(r.open), r.name))
        moving = sorted(leaving.open)
        narrate(f"stopping {leaving.name} (a deployment); it holds {moving}")
        t0 = trio.current_time()
        await leaving.stop()
        await _support.wait_until(converged, within=10, what="the handover")
        handover = trio.current_time() - t0
        holders.append(held())
        narrate(f"held: {holders[-1]}, {1000 * handover:.0f} ms after the stop began")

        desired.clear()
        narrate("configuration changed: desired connections []")

        async def all_closed() -> bool:
            # The handlers close while the reconcile that cancelled them is
            # still cancelling the rest: wait for its report too.
            reported = {c for r in replicas for res in r.reconciled for c in res.cancelled}
            return await converged() and {c.encode() for c in STEPS[-1]} <= reported

        await _support.wait_until(all_closed, within=10, what="every connection to close")
        holders.append(held())
        nursery.cancel_scope.cancel()

    reconciled = [
        (r.name, _names(res.added), _names(res.cancelled)) for r in replicas for res in r.reconciled
    ]
    return Report(holders, reconciled, leaving.name, handover)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``embedded_service.py [--namespace NS]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespace", default="example-service")
    args = parser.parse_args(argv)
    with _support.redis_url() as url:
        report = trio.run(lambda: run(url, namespace=args.namespace))
    added = sorted(a for _, adds, _ in report.reconciled for a in adds)
    cancelled = sorted(c for _, _, cs in report.reconciled for c in cs)
    ok = (
        added == ["cache", "db-primary", "metrics", "search"]
        and cancelled == ["cache", "db-primary", "metrics", "search"]
        and report.holders[-1] == {}
    )
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
