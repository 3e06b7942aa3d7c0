"""Redis memory: the eviction policy and how full Redis is, read from ``INFO
memory`` (which the least-privilege ACL allows with ``+info``; no ``CONFIG``),
and told once per change.

trio-mesh needs ``maxmemory-policy noeviction``: any other policy lets Redis
delete keys when it is full, leases and persistent tasks among them (the
``volatile-*`` policies evict keys with a TTL, leases first). With
``noeviction`` a full Redis refuses writes instead, and our scripts that add
tasks are refused before they write anything (see protocol/README.md, "At the
memory limit").

Who reads it: a worker's host (one :func:`watch_memory` trio task per
:func:`~mesh.open_worker` or per fleet, not per worker: a fleet of 1,000
workers polls once) every :data:`POLL_INTERVAL` seconds, and the client's
reads for ``mesh status``, the dashboard and the metrics exporter (one more
command in a pipeline they send anyway). Each keeps a :class:`MemoryWatch`,
which logs one error line when the policy becomes one that can evict (and one
info line when it is back to ``noeviction``), not one per poll.
"""

from __future__ import annotations

import logging
from typing import Any, Final, Protocol

import anyio
import anyio.abc
import attrs

from ._errors import CommandError, MeshConnectionError

__all__ = [
    "POLL_INTERVAL",
    "MemoryInfo",
    "MemoryWatch",
    "parse_memory_info",
    "read_memory",
    "watch_memory",
]

log = logging.getLogger("mesh.memory")

#: Seconds between two reads of ``INFO memory`` by a worker's host: a policy
#: switched at runtime is noticed within this (plus a round trip).
POLL_INTERVAL: Final = 5.0

#: The command that reads it (allowed by ``+info``).
INFO_MEMORY: Final = ("INFO", "memory")


@attrs.frozen
class MemoryInfo:
    """What ``INFO memory`` says about how Redis treats a full memory.

    Attributes:
        policy: ``maxmemory_policy``, e.g. ``"noeviction"``, ``"allkeys-lru"``.
        used: ``used_memory`` in bytes.
        maxmemory: ``maxmemory`` in bytes (0: no limit).
    """

    policy: str
    used: int
    maxmemory: int

    @property
    def evicting(self) -> bool:
        """Whether the policy lets Redis delete keys when full (any but
        ``noeviction``): leases and tasks may vanish."""
        return self.policy != "noeviction"

    @property
    def full(self) -> bool:
        """Whether Redis is at its limit: with ``noeviction``, writes that
        add data (enqueue, ensure, ...) are refused now."""
        return self.maxmemory > 0 and self.used >= self.maxmemory

    def text(self) -> str:
        """One line for ``mesh status``: used of max, the policy, and what
        is wrong, if anything."""
        limit = f"{_mb(self.maxmemory)} maxmemory" if self.maxmemory else "no maxmemory"
        line = f"{_mb(self.used)} used of {limit}, maxmemory-policy {self.policy}"
        if self.evicting:
            line += f"  ERROR: {self.policy} may evict leases and tasks; set noeviction"
        elif self.full:
            line += "  FULL: enqueue, ensure, schedule and configure are refused"
        return line


def _mb(n: int) -> str:
    return f"{n / 1048576:.1f} MB"


def parse_memory_info(raw: bytes | str) -> MemoryInfo:
    """Parse the reply of ``INFO memory`` (``key:value`` lines).

    Raises:
        ValueError: the reply lacks ``maxmemory_policy`` or ``used_memory``.
    """
    text = raw.decode() if isinstance(raw, bytes) else raw
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    try:
        return MemoryInfo(
            fields["maxmemory_policy"], int(fields["used_memory"]), int(fields.get("maxmemory", 0))
        )
    except (KeyError, ValueError) as exc:
        raise ValueError(f"INFO memory lacks maxmemory_policy or used_memory: {exc}") from exc


class _Executor(Protocol):
    async def execute(self, *args: Any) -> Any: ...


async def read_memory(conn: _Executor) -> MemoryInfo | None:
    """Read ``INFO memory``; None where the user may not run ``INFO`` (an ACL
    without ``+info``: see docs/operating.md) or the reply is not understood.

    Raises:
        MeshConnectionError: Redis could not be reached.
    """
    try:
        return parse_memory_info(await conn.execute(*INFO_MEMORY))
    except (CommandError, ValueError):
        return None


class MemoryWatch:
    """What one process last learnt of Redis's memory, and the log lines
    about it: one error line when the policy becomes one that can evict (or
    changes to another one), one info line when it is back to
    ``noeviction``, one warning when ``INFO`` cannot be read; never one per
    poll. Sync, no I/O: :func:`watch_memory` and the client's reads feed it.

    Attributes:
        info: the last reading (None: none yet, or ``INFO`` not allowed).
        who: names the process in log lines (``worker <id>``, ``client``).
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.info: MemoryInfo | None = None
        self._told: str | None = None  # the policy last logged ("" : noeviction)
        self._unreadable_told = False

    @property
    def evicting(self) -> bool:
        """Whether the last reading showed a policy that can evict."""
        return self.info is not None and self.info.evicting

    def update(self, info: MemoryInfo | None) -> None:
        """Take a reading (None: ``INFO`` refused) and log what changed."""
        if info is None:
            if not self._unreadable_told:
                self._unreadable_told = True
                log.warning(
                    "%s: cannot read INFO memory (the ACL lacks +info?): a maxmemory-policy "
                    "that evicts leases and tasks would go unnoticed",
                    self.who,
                )
            return
        self.info = info
        told = info.policy if info.evicting else ""
        if told == (self._told or ""):
            self._told = told
            return
        self._told = told
        if info.evicting:
            log.error(
                "%s: Redis maxmemory-policy is %s: Redis may evict leases, processes and "
                "persistent tasks when full; trio-mesh needs noeviction "
                "(CONFIG SET maxmemory-policy noeviction)",
                self.who,
                info.policy,
            )
        else:
            log.info("%s: Redis maxmemory-policy is noeviction again", self.who)


async def watch_memory(
    conn: _Executor,
    watch: MemoryWatch,
    interval: float = POLL_INTERVAL,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Read ``INFO memory`` every ``interval`` seconds into ``watch`` (one
    command per interval for the whole host). Runs until cancelled; a read
    that fails (Redis unreachable) is skipped, the next one is on time.
    Cancellation passes through."""
    task_status.started()
    while True:
        try:
            watch.update(await read_memory(conn))
        except MeshConnectionError:
            pass  # the heartbeat says so; read again next time
        await anyio.sleep(interval)
