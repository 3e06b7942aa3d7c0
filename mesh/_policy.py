"""The policy of a queue: stored in Redis (``configure.lua``), applied by every
worker that serves the queue.

A queue's policy is its attempt limit, retry backoff, handler timeout and
result TTL. ``Client.configure`` writes it; a worker's ``start_work``
options become the policy of a queue that has none; a worker whose options
differ from the stored policy logs a warning and applies the stored one.
Workers read the policies of their queues when they start serving them and
again on every heartbeat interval.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import attrs

from ._errors import CommandError, ConfigError, MeshConnectionError, ProtocolError
from ._units import seconds_ms
from ._validate import is_whole, seconds_field, whole, whole_field

__all__ = [
    "PolicyWatch",
    "QueuePolicy",
    "apply_stored",
    "differences",
    "parse_policy",
    "policy_fields",
    "watch_policies",
]

log = logging.getLogger("mesh.worker")


@attrs.frozen
class QueuePolicy:
    """The policy of a queue (see :meth:`Client.configure`).

    Raises:
        ConfigError: on construction, a value out of range (a count that is
            not a whole number >= 0, seconds that are not a finite number
            >= 0), or ``backoff`` above ``backoff_max``.

    Attributes:
        max_attempts: failed attempts after which a one-shot task is
            dead-lettered (0: no limit).
        backoff: seconds before the first retry; the n-th waits
            ``backoff * 2**(n-1)``, capped at ``backoff_max``.
        backoff_max: the cap, in seconds.
        timeout: a handler running longer is cancelled and the attempt
            counts as failed (0.0: no timeout).
        rate_limit: at most this many claims per ``rate_period`` seconds
            across the whole mesh (0: no limit).
        rate_period: the period of the rate limit, in seconds.
        result_ttl: seconds a finished task's return value (or a dead
            letter's failure) is kept for :meth:`Client.result` (0.0: results
            are not kept).
        enqueue_times: whether the queue keeps the first enqueue time of
            each of its one-shot jobs (:attr:`Job.enqueued`; a write per
            job, and a copy of each waiting or running entry in Redis).
        source: who wrote it: ``"configure"``, or ``"worker <id>"`` when the
            ``start_work`` options of that worker became the policy of a
            queue that had none.
    """

    max_attempts: int = attrs.field(default=5, validator=whole_field())
    backoff: float = attrs.field(default=1.0, validator=seconds_field())
    backoff_max: float = attrs.field(default=60.0, validator=seconds_field())
    timeout: float = attrs.field(default=0.0, validator=seconds_field())
    result_ttl: float = attrs.field(default=0.0, validator=seconds_field())
    rate_limit: int = attrs.field(default=0, validator=whole_field())
    rate_period: float = attrs.field(default=1.0, validator=seconds_field())
    source: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    enqueue_times: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.backoff > self.backoff_max:
            raise ConfigError(
                f"need backoff <= backoff_max, got {self.backoff!r}, {self.backoff_max!r}"
            )


_MS_FIELDS = {
    "backoff": "backoff_ms",
    "backoff_max": "backoff_max_ms",
    "timeout": "timeout_ms",
    "result_ttl": "result_ttl_ms",
}


def parse_policy(raw: bytes | str, queue: str) -> QueuePolicy:
    """A :class:`QueuePolicy` from the JSON that ``configure.lua`` stores.

    Raises:
        ProtocolError: not the documented shape, or a value out of range.
    """
    try:
        d = json.loads(raw)
        return QueuePolicy(
            int(d["max_attempts"]),
            int(d["backoff_ms"]) / 1000,
            int(d["backoff_max_ms"]) / 1000,
            int(d["timeout_ms"]) / 1000,
            int(d["result_ttl_ms"]) / 1000,
            int(d.get("rate_limit", 0)),
            int(d.get("rate_period_ms", 1000)) / 1000,
            str(d.get("source", "")),
            bool(int(d.get("enqueue_times", 0))),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"malformed policy of queue {queue}: {exc}") from None


def _ms(name: str, value: object) -> int:
    try:
        return seconds_ms(name, value)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None


def policy_fields(**given: Any) -> list[Any]:
    """The ``configure.lua`` field/value arguments for the options given
    (those not None): seconds become ms.

    Raises:
        ConfigError: a value out of range, or backoff above backoff_max.
    """
    out: list[Any] = []
    for name, value in given.items():
        if value is None:
            continue
        if name == "rate_limit":
            bad = f"rate_limit must be N or (N, seconds) with N >= 0, got {value!r}"
            if isinstance(value, int):
                n, per = value, 1.0
            elif isinstance(value, tuple) and len(value) == 2:
                n, per = value
            else:
                raise ConfigError(bad)
            if not is_whole(n) or n < 0:
                raise ConfigError(bad)
            whole("rate_limit", n)  # at most MAX_COUNT
            ms = _ms("rate_limit period", per)
            if n > 0 and ms < 1:
                raise ConfigError(f"the rate_limit period must be at least 1 ms, got {per!r}")
            out += ["rate_limit", n, "rate_period_ms", max(ms, 1)]
        elif name == "enqueue_times":
            if not isinstance(value, bool):
                raise ConfigError(f"enqueue_times must be True or False, got {value!r}")
            out += ["enqueue_times", int(value)]
        elif name == "max_attempts":
            out += ["max_attempts", whole("max_attempts", value)]
        elif name in _MS_FIELDS:
            out += [
                _MS_FIELDS[name],
                _ms(name, value),
            ]
        else:
            raise ConfigError(f"unknown policy option {name}")
    b, bm = given.get("backoff"), given.get("backoff_max")
    if b is not None and bm is not None and b > bm:
        raise ConfigError(f"need backoff <= backoff_max, got {b!r}, {bm!r}")
    return out


def differences(policy: QueuePolicy, explicit: dict[str, Any]) -> list[str]:
    """``name=value`` of each explicit ``start_work`` option that the stored
    policy overrides, for the warning."""
    return [
        f"{name}={value!r} (the queue's policy says {getattr(policy, name)!r})"
        for name, value in explicit.items()
        if value != getattr(policy, name)
    ]


@attrs.frozen
class PolicyWatch:
    """The stored policies a worker re-reads: those of the queues that
    ``runners`` (a live mapping) names, in the hash ``key``; ``apply`` gets
    each one that exists. The scheduler reads them in its own round trip
    (``run_scheduler``), so a worker pays one round trip per heartbeat
    interval for both."""

    key: str
    runners: Mapping[str, Any]
    apply: Callable[[str, QueuePolicy], None]

    def queues(self) -> list[str]:
        return sorted(self.runners)


def apply_stored(
    queues: list[str], raws: list[bytes | None], apply: Callable[[str, QueuePolicy], None]
) -> None:
    """``apply`` each stored policy of ``queues`` (an ``HMGET`` reply) that
    exists; one that cannot be parsed is logged and skipped."""
    for q, raw in zip(queues, raws, strict=True):
        if raw is None:
            continue
        try:
            policy = parse_policy(raw, q)
        except ProtocolError as exc:
            log.warning("reading the policy of queue %s failed: %s", q, exc)
            continue
        apply(q, policy)


async def watch_policies(
    conn: Any,
    policy_key: str,
    runners: Mapping[str, Any],
    apply: Callable[[str, QueuePolicy], None],
    interval: float,
) -> None:
    """Every ``interval`` seconds, read the stored policies of the queues
    that ``runners`` (a live mapping) names (one ``HMGET``) and ``apply`` each one that
    exists. A queue whose policy was cleared keeps what it had. Errors are
    logged and retried at the next interval; runs until cancelled."""
    while True:
        await anyio.sleep(interval)
        queues = sorted(runners)
        if not queues:
            continue
        try:
            apply_stored(queues, await conn.execute("HMGET", policy_key, *queues), apply)
        except (MeshConnectionError, CommandError, ProtocolError) as exc:
            log.warning("reading the queue policies failed: %s", exc)
