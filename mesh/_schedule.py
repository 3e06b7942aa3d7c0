"""Periodic tasks: a schedule enqueues one one-shot copy of its payload on
each tick, exactly once across the mesh.

A schedule is unique per (queue, payload) and lives in Redis
(``{ns}:schedules``: id -> next tick, ``{ns}:schedule_specs``: id -> spec);
``schedule.lua`` adds, replaces and removes one. Every worker runs
:func:`run_scheduler`: it sleeps until the first tick is due (by the Redis
clock, re-read at least every heartbeat interval), then calls ``fire.lua``
with the ticks it read and the next tick of each. ``fire.lua`` fires a tick
only if the schedule still has exactly that tick, so when several peers try
at once one of them fires it and the others change nothing; a peer that dies
does not stop the others from firing. The next tick is the first one after
the Redis time the peer read: after an outage (no peer running) a schedule
fires once, not once per missed tick.

Cron expressions are evaluated in UTC with ``cronsim`` (the ``[cron]``
extra), imported only when a cron schedule is used.
"""

from __future__ import annotations

import logging
import math
import random
from datetime import UTC, datetime
from typing import Any

import anyio
import attrs

from ._errors import CommandError, ConfigError, MeshConnectionError, ProtocolError
from ._policy import PolicyWatch, apply_stored
from ._units import seconds_ms

__all__ = ["Schedule", "cron_next", "next_tick", "parse_spec", "run_scheduler", "spec_of"]

log = logging.getLogger("mesh.worker")

#: The shortest period of an ``every`` schedule, in seconds.
MIN_EVERY = 0.05

_BATCH = 100  # schedules read (and fired) per round trip


@attrs.frozen
class Schedule:
    """A periodic task (see :meth:`Client.schedule`).

    Attributes:
        queue: where each tick enqueues a copy.
        task: the payload.
        every: the period in seconds, or None for a cron schedule.
        cron: the cron expression (UTC), or None.
        next_run: the next tick, Unix time on the Redis clock.
    """

    queue: str
    task: bytes
    every: float | None
    cron: str | None
    next_run: float


def _cronsim() -> Any:
    try:
        import cronsim
    except ImportError:
        raise ConfigError(
            "cron schedules need the cronsim package: pip install 'trio-mesh[cron]'"
        ) from None
    return cronsim


def cron_next(expr: str, after_ms: int) -> int:
    """The first tick of cron expression ``expr`` (UTC) strictly after
    ``after_ms`` (ms since the epoch), in ms.

    Raises:
        ConfigError: a bad expression, or cronsim is not installed.
    """
    cronsim = _cronsim()
    # cronsim counts whole seconds and may yield the start itself
    start = datetime.fromtimestamp(after_ms // 1000, UTC)
    try:
        it = cronsim.CronSim(expr, start)
        for _ in range(3):
            t: int = round(next(it).timestamp() * 1000)
            if t > after_ms:
                return t
    except (cronsim.CronSimError, StopIteration) as exc:
        raise ConfigError(f"bad cron expression {expr!r}: {exc}") from None
    raise ConfigError(f"cron expression {expr!r} has no tick after {after_ms} ms")


def spec_of(every: float | None, cron: str | None) -> str:
    """The stored spec of a schedule: ``every <ms>`` or ``cron <expr>``.

    Raises:
        ConfigError: neither or both given, a period below 0.05 s, a bad
            cron expression (or cronsim missing).
        TypeError: not a number or a str.
    """
    if (every is None) == (cron is None):
        raise ConfigError("give every (seconds) or cron (an expression), exactly one")
    if every is not None:
        return f"every {seconds_ms('every', every, minimum=MIN_EVERY)}"
    if not isinstance(cron, str):
        raise TypeError(f"cron must be a str, not {type(cron).__name__}")
    expr = " ".join(cron.split())
    cron_next(expr, 0)  # validates
    return f"cron {expr}"


def parse_spec(spec: bytes) -> tuple[float | None, str | None]:
    """(every seconds, cron expression) of a stored spec.

    Raises:
        ProtocolError: not a spec.
    """
    text = spec.decode(errors="replace")
    kind, _, rest = text.partition(" ")
    if kind == "every" and rest.isdigit():
        return int(rest) / 1000, None
    if kind == "cron" and rest:
        return None, rest
    raise ProtocolError(f"malformed schedule spec {text!r}")


def next_tick(spec: bytes, tick_ms: int, now_ms: int) -> int:
    """The tick after ``tick_ms`` of a schedule, skipping ticks up to
    ``now_ms`` (missed while no peer ran): the first one after ``now_ms``."""
    every, cron = parse_spec(spec)
    if every is not None:
        period = max(1, round(every * 1000))
        if now_ms < tick_ms + period:
            return tick_ms + period
        return tick_ms + period * ((now_ms - tick_ms) // period + 1)
    assert cron is not None
    return cron_next(cron, max(tick_ms, now_ms))


def split_id(sid: bytes) -> tuple[str, bytes]:
    """(queue, payload) of a schedule id."""
    q, _, payload = sid.partition(b"\0")
    return q.decode(), payload


async def run_scheduler(
    conn: Any, binding: Any, interval: float, policies: PolicyWatch | None = None
) -> None:
    """Fire due ticks for as long as it runs (every worker runs one): sleep
    until the first tick is due, by the Redis clock, re-reading at least every
    ``interval`` seconds; then fire what is due. With ``policies``, the
    stored policies of the served queues are read in the same round trip,
    at most once per ``interval``. Errors are logged and retried; runs until
    cancelled."""
    keys = binding.keys
    policies_at = anyio.current_time() + interval
    while True:
        watch = None
        if policies is not None and anyio.current_time() >= policies_at:
            watch = policies
            policies_at = anyio.current_time() + interval
        try:
            wait = await _fire_due(conn, binding, keys, watch)
        except (MeshConnectionError, CommandError, ProtocolError, ConfigError) as exc:
            log.warning("firing periodic tasks failed: %s", exc)
            wait = interval
        if wait <= 0:
            continue
        # a little jitter: peers that woke for the same tick do not all call
        await anyio.sleep(min(wait, interval) + random.random() * min(0.02, interval / 10))


async def _fire_due(
    conn: Any, binding: Any, keys: Any, policies: PolicyWatch | None = None
) -> float:
    """Fire the due ticks among the first ones; seconds until the next one
    (0: call again at once; inf: no schedule). With ``policies``, read and
    apply the stored policies in the same round trip (a pipeline, not a
    transaction: Redis refuses MULTI at the memory limit, and each tick fires
    by compare-and-set anyway)."""
    queues = policies.queues() if policies is not None else []
    cmds: list[tuple[Any, ...]] = [
        ("TIME",),
        ("ZRANGE", keys.schedules, 0, _BATCH - 1, "WITHSCORES"),
    ]
    if queues:
        assert policies is not None
        cmds.append(("HMGET", policies.key, *queues))
    replies = await conn.pipeline(cmds)
    (sec, usec), flat = replies[0], replies[1]
    if queues:
        assert policies is not None
        apply_stored(queues, replies[2], policies.apply)
    now_ms = int(sec) * 1000 + int(usec) // 1000
    entries = [(flat[i], int(float(flat[i + 1]))) for i in range(0, len(flat), 2)]
    if not entries:
        return math.inf
    due = [(sid, tick) for sid, tick in entries if tick <= now_ms]
    if not due:
        return (entries[0][1] - now_ms) / 1000
    specs = await conn.execute("HMGET", keys.schedule_specs, *[sid for sid, _ in due])
    fire: list[tuple[bytes, int, int]] = []
    for (sid, tick), spec in zip(due, specs, strict=True):
        if spec is None:
            continue  # removed meanwhile
        try:
            fire.append((sid, tick, next_tick(spec, tick, now_ms)))
        except (ConfigError, ProtocolError) as exc:
            log.warning("schedule %r: %s; it is not fired", sid, exc)
    if fire:
        fired = await binding.fire(conn, fire)
        for (sid, _, _), f in zip(fire, fired, strict=True):
            if f == 2:
                q, payload = split_id(sid)
                log.warning(
                    "queue %s: a tick of the periodic task %r was skipped: the payload is a "
                    "persistent task of the queue",
                    q,
                    payload[:60],
                )
    # fired (or lost to a peer): look again at once; due but nothing to fire
    # (removed meanwhile, or a spec that cannot be evaluated): not in a loop
    return 0.0 if fire else 1.0
