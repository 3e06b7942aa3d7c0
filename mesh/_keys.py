"""Key and channel names of one namespace, and validation of the names that
become part of them. ``protocol/README.md`` is the contract this implements.

Every key of namespace ``ns`` starts with ``{ns}:`` so that all of them share
one Redis Cluster hash slot. A queue name is always the last part of a key or
channel, and worker ids and namespaces contain no ``:``, so no two names map
to the same key.
"""

from __future__ import annotations

import hashlib
import re

from ._errors import ConfigError

__all__ = ["Keys", "check_group", "check_queue", "check_worker_id"]

PROTOCOL_VERSION = "11"

_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_WORKER_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_QUEUE = re.compile(r"[A-Za-z0-9_.:/@+=-]{1,200}")
_QUEUE_RULE = "1 to 200 of the characters A-Z a-z 0-9 _ . : / @ + = -"


def check_queue(queue: object) -> str:
    """Return ``queue`` if it is a valid queue name.

    Raises:
        TypeError: not a str.
        ConfigError: not 1 to 200 of ``A-Z a-z 0-9 _ . : / @ + = -`` (so no
            spaces, braces, glob characters or control characters).
    """
    if not isinstance(queue, str):
        raise TypeError(f"queue name must be a str, not {type(queue).__name__}")
    if not _QUEUE.fullmatch(queue):
        raise ConfigError(f"invalid queue name {queue!r}: use {_QUEUE_RULE}")
    return queue


def check_group(group: object) -> str:
    """Return ``group`` if it is a valid group name (the rule of queue names).

    Raises:
        TypeError: not a str.
        ConfigError: not 1 to 200 of ``A-Z a-z 0-9 _ . : / @ + = -``.
    """
    if not isinstance(group, str):
        raise TypeError(f"group name must be a str, not {type(group).__name__}")
    if not _QUEUE.fullmatch(group):
        raise ConfigError(f"invalid group name {group!r}: use {_QUEUE_RULE}")
    return group


def check_worker_id(worker_id: object) -> str:
    """Return ``worker_id`` if valid: 1 to 128 of ``A-Z a-z 0-9 _ . -``.

    Raises:
        TypeError: not a str.
        ConfigError: invalid characters or length.
    """
    if not isinstance(worker_id, str):
        raise TypeError(f"worker id must be a str, not {type(worker_id).__name__}")
    if not _WORKER_ID.fullmatch(worker_id):
        raise ConfigError(
            f"invalid worker id {worker_id!r}: use 1 to 128 of the characters A-Z a-z 0-9 _ . -"
        )
    return worker_id


class Keys:
    """The key and channel names of one namespace.

    Raises:
        ConfigError: the namespace is not 1 to 64 of ``A-Z a-z 0-9 _ . -``.
    """

    __slots__ = (
        "cancel_prefix",
        "epoch",
        "info",
        "namespace",
        "policy",
        "prefix",
        "queues",
        "schedule_specs",
        "schedules",
        "token",
        "version",
        "wake_prefix",
        "workers",
    )

    def __init__(self, namespace: str) -> None:
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
        if not _NAMESPACE.fullmatch(namespace):
            raise ConfigError(
                f"invalid namespace {namespace!r}: use 1 to 64 of the characters A-Z a-z 0-9 _ . -"
            )
        self.namespace = namespace
        p = self.prefix = f"{{{namespace}}}:"
        self.token = p + "token"
        self.queues = p + "queues"
        self.workers = p + "workers"
        self.info = p + "info"
        self.version = p + "version"
        self.epoch = p + "epoch"
        self.policy = p + "policy"
        self.schedules = p + "schedules"
        self.schedule_specs = p + "schedule_specs"
        self.wake_prefix = p + "wake:"
        self.cancel_prefix = p + "cancel:"

    # per queue
    def queue(self, q: str) -> str:
        return f"{self.prefix}queue:{q}"

    def persistent(self, q: str) -> str:
        """HASH: the running persistent tasks of ``q``, payload -> process id."""
        return f"{self.prefix}persistent:{q}"

    def idle(self, q: str) -> str:
        """SET: the workers serving ``q`` with a free slot whose last claim
        found nothing (woken, one per ready task and a spare, by whoever
        makes tasks ready)."""
        return f"{self.prefix}idle:{q}"

    def moving(self, q: str) -> str:
        """HASH: process id -> "R:expiry ms", processes of ``q`` a rebalance
        asked their worker to hand back, for worker R."""
        return f"{self.prefix}moving:{q}"

    def reserved(self, q: str) -> str:
        """HASH: payload -> "R:expiry ms", persistent tasks of ``q`` handed
        back for balance and reserved for worker R."""
        return f"{self.prefix}reserved:{q}"

    def unowned(self, q: str) -> str:
        """ZSET: payload -> Redis time (ms) since when no process runs the
        persistent task of ``q`` (queued, delayed or reserved: since it was
        ensured, handed back or recycled)."""
        return f"{self.prefix}unowned:{q}"

    def timed(self) -> str:
        """SET: the queues that keep the enqueue times of their one-shot jobs
        (their policy's ``enqueue_times``; written by ``configure.lua``)."""
        return f"{self.prefix}timed"

    def enqt(self, q: str) -> str:
        """ZSET: payload (as queued: a big one's stand-in) -> Redis time (ms)
        it was first enqueued, for each waiting or running one-shot job of
        ``q`` while ``q`` keeps enqueue times (``include/enqueue_time.lua``)."""
        return f"{self.prefix}enqt:{q}"

    def share(self, q: str) -> str:
        """HASH: what the fair share of ``q`` weighs: the total weight of its
        persistent tasks (``:weight``) and capacity of its servers
        (``:capacity``), task weights (``w`` + payload) and server
        capacities (``c`` + worker id) other than 1, the extra weight each
        worker holds (``h`` + worker id), and a generation (``:gen``). See
        protocol/README.md."""
        return f"{self.prefix}share:{q}"

    def standby(self, q: str) -> str:
        """SET: the persistent tasks of ``q`` that are queued or delayed."""
        return f"{self.prefix}standby:{q}"

    def procs(self, q: str) -> str:
        return f"{self.prefix}procs:{q}"

    # A queue's groups (protocol/include/group.lua): the scripts make these
    # names themselves from the namespace's prefix; the reads use them here.

    def group_ready(self, q: str) -> str:
        """ZSET: the groups of ``q`` that may start a job now -> their place
        in line (a turn number: the lowest goes first)."""
        return f"{self.prefix}gready:{q}"

    def groups(self, q: str) -> str:
        """HASH: per group of ``q`` its slots in use (``r:G``: of a group
        with a cap, its jobs running and retries waiting; of one without,
        its retries), own
        settings (``c:G``) and pause (``p:G``); ``:default``, ``:v``."""
        return f"{self.prefix}groups:{q}"

    def group_wait(self, q: str) -> str:
        """ZSET: the groups of ``q`` waiting for a token -> when (ms)."""
        return f"{self.prefix}gwait:{q}"

    def group_delayed(self, q: str) -> str:
        """ZSET: ``G NUL flag level payload`` -> due time (ms)."""
        return f"{self.prefix}gdelayed:{q}"

    def group_jobs(self, q: str, g: str) -> str:
        """LIST: the queued jobs of group ``g`` of ``q`` without a priority."""
        return f"{self.prefix}gq:{q}|{g}"

    def blob(self, sha: str) -> str:
        """HASH: the payload stored out of line whose SHA-1 is ``sha`` (hex):
        ``d`` the payload, ``n`` the entries that reference it
        (:mod:`mesh._blob`)."""
        return f"{self.prefix}blob:{sha}"

    def group_prio(self, q: str, g: str) -> str:
        """ZSET: the queued jobs of group ``g`` of ``q`` with a priority
        (as :meth:`prio`)."""
        return f"{self.prefix}gp:{q}|{g}"

    def attempts(self, q: str) -> str:
        return f"{self.prefix}attempts:{q}"

    def delayed(self, q: str) -> str:
        return f"{self.prefix}delayed:{q}"

    def prio(self, q: str) -> str:
        """ZSET: the queued tasks of ``q`` with a priority (1..9), scored
        -priority, each member the priority digit, a 15-digit order number
        and the payload."""
        return f"{self.prefix}prio:{q}"

    def delayed_prio(self, q: str) -> str:
        """HASH: payload -> priority of a delayed task of ``q`` that has one."""
        return f"{self.prefix}delayed_prio:{q}"

    def dead(self, q: str) -> str:
        return f"{self.prefix}dead:{q}"

    def tries(self, q: str) -> str:
        """HASH: SHA-1 of a payload of ``q`` -> its last failed attempts
        (JSON ``[[when_ms, worker, error], ...]``, at most 5, oldest first),
        written by ``give_back.lua`` on a failure only."""
        return f"{self.prefix}tries:{q}"

    def tried(self, q: str) -> str:
        """ZSET: SHA-1 of a payload of ``q`` -> when its last attempt failed
        (ms); at most 1000: the oldest leaves with its :meth:`tries` field."""
        return f"{self.prefix}tried:{q}"

    def result(self, q: str, payload: bytes) -> str:
        """STRING: the result record of the latest finished instance of
        ``payload`` on ``q`` (queues with a result TTL only). The payload is
        named by its SHA-1, so the key is short and the queue name last."""
        return f"{self.prefix}result:{hashlib.sha1(payload).hexdigest()}:{q}"

    def paused(self, q: str) -> str:
        """STRING: present while ``q`` is paused, since when (Redis ms)."""
        return f"{self.prefix}paused:{q}"

    def stats(self, q: str) -> str:
        """HASH: per-minute counts of processes of ``q`` finished (``p`` +
        minute) and failed (``f`` + minute), added by workers every few
        seconds (``stats.lua``)."""
        return f"{self.prefix}stats:{q}"

    def rate(self, q: str) -> str:
        """HASH: the token bucket of ``q``'s rate limit (tokens, at)."""
        return f"{self.prefix}rate:{q}"

    def servers(self, q: str) -> str:
        return f"{self.prefix}servers:{q}"

    # per worker
    def heartbeat(self, w: str) -> str:
        return f"{self.prefix}worker:{w}"

    def serves(self, w: str) -> str:
        return f"{self.prefix}serves:{w}"

    def inbox(self, w: str) -> str:
        return f"{self.prefix}inbox:{w}"

    def held(self, w: str, q: str) -> str:
        return f"{self.prefix}held:{w}:{q}"

    # channels
    def wake_channel(self, w: str) -> str:
        """Where worker ``w`` hears that a queue it serves has tasks for it."""
        return self.wake_prefix + w

    def done_channel(self, q: str) -> str:
        return f"{self.prefix}done:{q}"

    def awaiting(self, q: str) -> str:
        """STRING with a TTL that exists while someone awaits ``q``'s done
        messages: finish.lua publishes them only then."""
        return f"{self.prefix}awaiting:{q}"

    def delete_channel(self, q: str) -> str:
        return f"{self.prefix}delete:{q}"

    def cancel_channel(self, w: str) -> str:
        return self.cancel_prefix + w

    def parse_heartbeat_key(self, key: bytes) -> str | None:
        """The worker id of a heartbeat key name, or None if it is not one of ours."""
        head = (self.prefix + "worker:").encode()
        return key[len(head) :].decode() if key.startswith(head) else None
