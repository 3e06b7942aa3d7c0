"""What the dashboard shows, as JSON: one :class:`Poller` per dashboard reads
the mesh every ``interval`` (two round trips, see :func:`mesh._view.overview`)
however many browsers watch, and keeps a timeline of takeovers by comparing
successive reads."""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import attrs

from .._blob import payload_size
from .._browse import fingerprint
from .._client import Client
from .._epoch import EPOCH_MISSING_HINT
from .._errors import MeshError
from .._reads import JOB_STATES, QUEUE_COUNTS
from .._types import Process
from .._view import Overview, overview, share_text, show_payload
from ._text import shown

__all__ = ["Poller", "Tracker", "show_payload"]

log = logging.getLogger("mesh.dashboard")

#: At most this many persistent tasks are listed (the counts stay exact).
MAX_PERSISTENT_ROWS = 500


def _key(task: bytes) -> str:
    """The short key of a persistent task's row: a fingerprint of its payload
    (the state never carries a whole payload: one may be 64 MiB)."""
    return fingerprint(task)


class Tracker:
    """Turns successive :class:`~mesh._view.Overview` reads into the page's
    state, and notices takeovers of persistent tasks: a task whose owning
    process changed. Its duration is from when the old owner lost it (its
    lease deadline, if that passed before the new claim: ``recycled``; else
    the last read that saw it owned: ``handed back``, an upper bound) to the
    new process's start, all by the Redis clock."""

    def __init__(self, *, keep: int = 50) -> None:
        self._owners: dict[tuple[str, bytes], Process] = {}
        self._lost: dict[tuple[str, bytes], Process] = {}
        self._seen_owned_at: dict[tuple[str, bytes], float] = {}
        self._deadlines: dict[str, float] = {}
        self.takeovers: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        #: The payloads of the rows of the last state, by (queue, key): what
        #: a cancel from a row names.
        self.payloads: dict[tuple[str, str], bytes] = {}

    def update(self, ov: Overview) -> dict[str, Any]:
        """The page's state for ``ov``; records the takeovers since the last one."""
        persistent = [p for p in ov.processes if p.persistent]
        owners = {(p.queue, p.task): p for p in persistent}
        for key, new in owners.items():
            old = self._owners.get(key) or self._lost.get(key)
            if old is not None and old.id != new.id:
                self._record(key, old, new)
        # Tasks that lost their owner and wait for a new one (cancelled ones
        # leave the unowned set, and are forgotten).
        unowned = {(q.info.name, t) for q in ov.queues for t in q.unowned}
        lost = {k: p for k, p in self._lost.items() if k in unowned}
        lost.update((k, p) for k, p in self._owners.items() if k in unowned)
        self._lost = lost
        for key in owners:
            self._seen_owned_at[key] = ov.now
        self._seen_owned_at = {
            k: t for k, t in self._seen_owned_at.items() if k in owners or k in lost
        }
        self._owners = owners
        for w in ov.workers:
            # A deadline that has passed stays: the lease ran out, and what
            # moves it later is a peer's reap lease (reap_check.lua), not a
            # renewal, which would make a recycled task look handed back.
            was = self._deadlines.get(w.id)
            if was is None or was > ov.now:
                self._deadlines[w.id] = ov.now + w.lease_left
        keep = {w.id for w in ov.workers} | {p.worker_id for p in lost.values()}
        self._deadlines = {w: d for w, d in self._deadlines.items() if w in keep}
        return self._state(ov, persistent)

    def _record(self, key: tuple[str, bytes], old: Process, new: Process) -> None:
        deadline = self._deadlines.get(old.worker_id)
        if deadline is not None and deadline <= new.started:
            kind, lost_at = "recycled", deadline
        else:
            kind, lost_at = "handed back", self._seen_owned_at.get(key, new.started)
        self.takeovers.appendleft(
            {
                "at": new.started,
                "queue": key[0],
                "task": shown(key[1], len(key[1])),
                "from": old.worker_id,
                "to": new.worker_id,
                "kind": kind,
                "duration": round(max(new.started - lost_at, 0.0), 3),
            }
        )

    def _state(self, ov: Overview, persistent: list[Process]) -> dict[str, Any]:
        workers = []
        for w in ov.workers:
            workers.append(
                {
                    "id": w.id,
                    "alive": w.alive,
                    "age": round(ov.now - w.started, 1) if w.started else None,
                    "lease_left": round(w.lease_left, 2),
                    "queues": list(w.queues),
                    "processes": w.processes,
                    # what it holds against its fair share, by weight against
                    # capacity, as `mesh status` shows it (Client.workers);
                    # over it on a queue where it holds more than one process
                    # (a single heavy task over the share is as balanced as
                    # can be)
                    "share": share_text(w.shares),
                    "over": any(
                        sh.weight > sh.fair_max and sh.held > 1 for sh in w.shares if sh.fair_max
                    ),
                    "host": w.host,
                    "pid": w.pid,
                }
            )
        rows: list[dict[str, Any]] = []
        payloads: dict[tuple[str, str], bytes] = {}
        for p in persistent[:MAX_PERSISTENT_ROWS]:
            payloads[(p.queue, _key(p.task))] = p.task
            rows.append(
                {
                    "queue": p.queue,
                    "task": shown(p.task, payload_size(p.task)),
                    "key": _key(p.task),
                    "size": payload_size(p.task),  # a big one's: its stand-in says
                    "owner": p.worker_id,
                    "token": str(p.token),
                    "age": round(ov.now - p.started, 1),
                }
            )
        for qc in ov.queues:
            for t in qc.unowned:
                if len(rows) >= MAX_PERSISTENT_ROWS:
                    break
                payloads[(qc.info.name, _key(t))] = t
                rows.append(
                    {
                        "queue": qc.info.name,
                        "task": shown(t, payload_size(t)),
                        "key": _key(t),
                        "size": payload_size(t),
                        "owner": None,
                        "token": None,
                        # how long it has had no owner (Redis keeps since when)
                        "age": round(ov.now - qc.unowned_since.get(t, ov.now), 1),
                    }
                )
        self.payloads = payloads
        return {
            "now": ov.now,
            "error": None,
            "workers": workers,
            "queues": [
                {
                    "name": q.info.name,
                    **{c.name: getattr(q.info, c.name) for c in QUEUE_COUNTS},
                    "owned": q.persistent_owned,
                    "unowned": len(q.unowned),
                    "paused": q.info.paused,
                }
                for q in ov.queues
            ],
            "persistent": rows,
            "persistent_total": sum(q.info.persistent for q in ov.queues),
            "takeovers": list(self.takeovers),
            "memory": attrs.asdict(ov.memory) if ov.memory is not None else None,
            "alerts": _alerts(ov),
            "epoch_missing": ov.epoch_missing,
        }


def _alerts(ov: Overview) -> list[str]:
    """What the page shows in red above everything: a Redis that may evict
    leases and tasks, a full Redis, persistent tasks that vanished."""
    out = []
    m = ov.memory
    if m is not None and m.evicting:
        out.append(
            f"Redis maxmemory-policy is {m.policy}: it may evict leases and tasks "
            "(trio-mesh needs noeviction)"
        )
    elif m is not None and m.full:
        out.append("Redis is at maxmemory: enqueue, ensure, schedule and configure are refused")
    if ov.epoch_missing:
        out.append(f"The namespace's epoch is missing: {EPOCH_MISSING_HINT}")
    for q in ov.queues:
        if q.vanished:
            out.append(
                f"queue {q.info.name}: {q.vanished} persistent task(s) vanished without a cancel"
            )
    return out


class Poller:
    """Reads the mesh every ``interval`` seconds and publishes the page's
    state (a JSON text) to every watching browser.

    Args:
        redact: applied to error messages shown on the page (removes the
            Redis password, should one ever appear in one).
    """

    def __init__(
        self,
        client: Client,
        *,
        header: dict[str, str],
        interval: float = 1.0,
        redact: Callable[[str], str] = lambda s: s,
    ) -> None:
        self.client = client
        self.interval = interval
        # every state names the job states (the page's tabs), errors included
        self._header: dict[str, Any] = {**header, "states": list(JOB_STATES)}
        self.redact = redact
        self._tracker = Tracker()
        self._info: dict[str, dict[str, Any]] = {}
        self.state = json.dumps({**self._header, "now": None, "error": "connecting"})
        self.version = 0
        self._changed = anyio.Event()

    def persistent_payload(self, queue: str, key: str) -> bytes | None:
        """The payload of the persistent task whose row (in the last state)
        has ``key``, or None."""
        return self._tracker.payloads.get((queue, key))

    async def poll_once(self) -> None:
        """Read the mesh once and publish the result (or the error)."""
        try:
            ov = await overview(self.client.reads, self._info)
        except MeshError as exc:
            epoch = self.client.reads.epoch
            state: dict[str, Any] = {
                "now": None,
                "error": self.redact(str(exc)),
                # refused a node that lacks the epoch: the error says what to do
                "epoch_missing": epoch is not None and epoch.refused,
            }
        else:
            state = self._tracker.update(ov)
        self.state = json.dumps({**self._header, **state}, separators=(",", ":"))
        self.version += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Poll until cancelled (errors are shown on the page, and retried)."""
        await self.poll_once()
        task_status.started()
        while True:
            await anyio.sleep(self.interval)
            await self.poll_once()

    async def wait_changed(self, version: int) -> None:
        """Return once the state is newer than ``version``."""
        while self.version <= version:
            await self._changed.wait()
