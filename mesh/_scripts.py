"""The protocol binding: one typed Python call per Lua script in ``protocol/``.

It knows keys, scripts and reply shapes, and nothing about trio tasks: every
call takes the connection to run on. Scripts run with ``EVALSHA``; on
``NOSCRIPT`` (a restarted server, ``SCRIPT FLUSH``) the same call is sent again
as ``EVAL`` with the source, which also caches the script, so a flush is
invisible to callers.

A script's ``--!include FILE`` lines are replaced by the files they name
(``include/NAME.lua``, each spliced once per script) before the script is
hashed and sent: plain text, see "Loading the scripts" in
``protocol/README.md``.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import attrs
import outcome

from ._errors import (
    CommandError,
    ConfigError,
    ConflictError,
    FencedError,
    MeshConnectionError,
    ProtocolError,
    out_of_memory,
)
from ._keys import PROTOCOL_VERSION, Keys
from ._transport import Packed
from ._types import DeadLetter, Process

__all__ = [
    "Binding",
    "Executor",
    "HeartbeatRequest",
    "PipelineExecutor",
    "Script",
    "ScriptCall",
    "load_scripts",
    "payload_bytes",
    "run_pipelined",
    "run_reads",
]

T = TypeVar("T")

SCRIPT_NAMES = (
    "register",
    "serve",
    "heartbeat",
    "claim",
    "finish",
    "finish_claim",
    "give_back",
    "unserve",
    "drain",
    "recycle",
    "reap_check",
    "enqueue",
    "ensure",
    "cancel",
    "delete_queue",
    "delay",
    "dead",
    "configure",
    "finish_results",
    "schedule",
    "fire",
    "rebalance",
    "read",
    "peek",
    "recount",
    "pause",
    "stats",
)

# An include line, with its line end: the file it names (a path relative to
# protocol/) replaces it.
_INCLUDE = re.compile(rb"^--!include ((?:[A-Za-z0-9_-]+/)*[A-Za-z0-9_-]+\.lua)[ \t]*(?:\n|$)", re.M)

# Error codes our scripts reply with, and the exception each becomes.
_ERRORS: dict[str, type[Exception]] = {
    "FENCED": FencedError,
    "VERSION": ProtocolError,
    "DUPLICATE_WORKER": ConfigError,
    "CONFLICT": ConflictError,
}


class Executor(Protocol):
    """What the binding needs of a connection."""

    async def execute(self, *args: bytes | str | int | float) -> Any: ...


class PipelineExecutor(Executor, Protocol):
    """What :func:`run_pipelined` needs: a connection that sends several
    commands in one write, in order (:meth:`Connection.pipeline`)."""

    async def pipeline(
        self, commands: Sequence[Sequence[bytes | str | int | float]], *, raise_on_error: bool
    ) -> list[Any]: ...


@attrs.frozen
class Script:
    name: str
    source: bytes = attrs.field(repr=False)
    sha: str


def _protocol_dir() -> Traversable:
    try:
        d = resources.files("mesh.protocol")
        if d.joinpath("claim.lua").is_file():
            return d
    except ModuleNotFoundError:
        pass
    # A source checkout used without installing: protocol/ beside mesh/.
    return Path(__file__).resolve().parent.parent / "protocol"


def _expand(d: Traversable, name: str, stack: tuple[str, ...], done: set[str]) -> bytes:
    """The text of ``name`` with every include line replaced by the expanded
    text of the file it names, but for a file already spliced into this
    script (``done``): its line is dropped. Plain text, no parsing of Lua.

    Raises:
        ProtocolError: ``name`` includes itself, directly or not (a cycle).
        FileNotFoundError: ``name`` or a file it includes does not exist.
    """
    if name in stack:
        raise ProtocolError(f"protocol/{name}: include cycle {' -> '.join((*stack, name))}")
    f = d
    for part in name.split("/"):
        f = f.joinpath(part)
    text = f.read_bytes()

    def splice(m: re.Match[bytes]) -> bytes:
        file = m.group(1).decode()
        if file in done:
            return b""
        out = _expand(d, file, (*stack, name), done)
        done.add(file)
        return out

    return _INCLUDE.sub(splice, text)


def expand_script(d: Traversable, name: str) -> bytes:
    """The source of script ``name`` (a path relative to ``d``, the
    protocol directory) as it is hashed and sent: see "Loading the scripts"
    in ``protocol/README.md``.

    Raises:
        ProtocolError: an include cycle.
        FileNotFoundError: the script or a file it includes does not exist.
    """
    return _expand(d, name, (), set())


@functools.cache
def load_scripts() -> Mapping[str, Script]:
    """Read, expand and hash every script (once per process).

    Raises:
        ProtocolError: a script file is missing (a broken install).
    """
    d = _protocol_dir()
    out = {}
    for name in SCRIPT_NAMES:
        try:
            src = expand_script(d, name + ".lua")
        except FileNotFoundError as exc:
            raise ProtocolError(f"protocol script {name}.lua not found in {d}") from exc
        out[name] = Script(name, src, hashlib.sha1(src).hexdigest())
    return out


def payload_bytes(task: object, limit: int | None = None) -> bytes:
    """A task payload as bytes: ``str`` is encoded as UTF-8, bytes-likes are copied.

    Raises:
        TypeError: neither str nor bytes-like.
        ValueError: longer than ``limit`` bytes.
    """
    if isinstance(task, bytes):
        b = task
    elif isinstance(task, str):
        b = task.encode()
    elif isinstance(task, bytearray | memoryview):
        b = bytes(task)
    else:
        raise TypeError(f"a task payload must be bytes or str, not {type(task).__name__}")
    if limit is not None and len(b) > limit:
        raise ValueError(f"task payload is {len(b)} bytes; the limit (max_payload) is {limit}")
    return b


def _map_error(exc: CommandError) -> Exception:
    cls = _ERRORS.get(exc.code)
    if cls is None:
        return out_of_memory(exc) or exc
    msg = str(exc)
    if msg.startswith(exc.code + " "):
        msg = msg[len(exc.code) + 1 :]
    return cls(msg)


async def run_script(
    conn: Executor, script: Script, keys: Sequence[str], args: Sequence[Any]
) -> Any:
    """Run one script: EVALSHA, falling back to EVAL on NOSCRIPT.

    Raises:
        FencedError, ProtocolError, ConfigError, ConflictError: the script's
            error codes (see protocol/README.md).
        OutOfMemoryError: Redis is at maxmemory and refused the script's
            first write (nothing was written).
        CommandError: any other error reply.
        MeshConnectionError: from the connection.
    """
    try:
        try:
            return await conn.execute("EVALSHA", script.sha, len(keys), *keys, *args)
        except CommandError as exc:
            if exc.code != "NOSCRIPT":
                raise
            return await conn.execute("EVAL", script.source, len(keys), *keys, *args)
    except CommandError as exc:
        mapped = _map_error(exc)
        if mapped is exc:
            raise
        raise mapped from exc


async def run_reads(conn: Executor, commands: Sequence[Sequence[Any]]) -> list[Any]:
    """The replies of several read commands run as one step (``read.lua``):
    one consistent view of several keys, as ``MULTI``/``EXEC`` gives, that
    Redis also answers at the memory limit, where it refuses every command
    queued in a ``MULTI``. Each command's first argument is its key (but for
    ``TIME``); only the reads that ``read.lua`` lists are allowed.

    Raises:
        CommandError: a command's error (e.g. ``WRONGTYPE``) or ``BAD_ARG``
            (a command that is not a read): nothing of the call is answered.
        MeshConnectionError: from the connection.
    """
    keys: list[Any] = []
    seen: set[Any] = set()
    args: list[Any] = []
    for name, *rest in commands:
        args += [len(rest), name, *rest]
        if rest and str(name).upper() != "TIME" and rest[0] not in seen:
            seen.add(rest[0])
            keys.append(rest[0])
    return list(await run_script(conn, load_scripts()["read"], keys, args))


@attrs.frozen
class ScriptCall(Generic[T]):
    """One script call, built but not sent (sans-IO): the script, its keys and
    arguments, and ``parse``, which turns the call's reply into its result."""

    script: Script
    keys: Sequence[str] = attrs.field(repr=False)
    args: Sequence[Any] = attrs.field(repr=False)
    parse: Callable[[Any], T] = attrs.field(repr=False)
    #: The ``EVALSHA`` command packed once (:class:`Packed`), for a call that
    #: is sent many times (see :meth:`Binding.claim_call`); None: built anew.
    evalsha: Packed | None = attrs.field(default=None, repr=False, eq=False)

    def command(self, *, source: bool = False) -> tuple[Any, ...]:
        """The ``EVALSHA`` command, or with ``source`` the ``EVAL`` one."""
        if source:
            return ("EVAL", self.script.source, len(self.keys), *self.keys, *self.args)
        if self.evalsha is not None:
            return self.evalsha
        return ("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args)

    def reusable(self) -> ScriptCall[T]:
        """The same call with its ``EVALSHA`` command packed once, to be sent
        many times (its keys and arguments are copied into tuples).

        Raises:
            ConfigError: an argument cannot be sent (as :meth:`Connection.execute`).
        """
        keys, args = tuple(self.keys), tuple(self.args)
        packed = Packed(("EVALSHA", self.script.sha, len(keys), *keys, *args))
        return ScriptCall(self.script, keys, args, self.parse, packed)


async def run_pipelined(
    conn: PipelineExecutor, calls: Sequence[ScriptCall[Any]]
) -> list[outcome.Outcome[Any]]:
    """Send several script calls in one write and return each one's outcome.

    Redis runs them in the order given, one after the other, with no command
    of another client in between (they arrive in one write); each is atomic
    on its own, not the group. Calls that got ``NOSCRIPT`` are sent again,
    together and in order, as ``EVAL``: should only some of them have got it
    (the script cache was flushed between two of them), those run after the
    others.

    Returns:
        Per call, in order: ``outcome.Value`` of its parsed reply, or
        ``outcome.Error`` of what :func:`run_script` would raise for it
        (FencedError and the other script error codes, CommandError).
    Raises:
        MeshConnectionError: from the connection; then it is unknown which of
            the calls ran.

    On cancellation, as for :meth:`Connection.pipeline`: the calls are
    dropped if they were not written yet, otherwise they run in Redis and
    their replies are discarded.
    """
    replies = await conn.pipeline([call.command() for call in calls], raise_on_error=False)
    results: list[outcome.Outcome[Any]] = []
    retry: list[int] = []
    for i, (call, reply) in enumerate(zip(calls, replies, strict=True)):
        if type(reply) is CommandError and reply.code == "NOSCRIPT":
            retry.append(i)
        results.append(_outcome(call, reply))
    if retry:
        replies = await conn.pipeline(
            [calls[i].command(source=True) for i in retry], raise_on_error=False
        )
        for i, reply in zip(retry, replies, strict=True):
            results[i] = _outcome(calls[i], reply)
    return results


def _outcome(call: ScriptCall[T], reply: Any) -> outcome.Outcome[T]:
    """What :func:`run_script` would return or raise for ``call``'s reply."""
    if isinstance(reply, CommandError):
        mapped = _map_error(reply)
        if mapped is not reply:
            mapped.__cause__ = reply
        return outcome.Error(mapped)
    try:
        return outcome.Value(call.parse(reply))
    except Exception as exc:  # a malformed reply: that call's error
        return outcome.Error(exc)


@attrs.frozen
class QueueBeat:
    """What one heartbeat says about one served queue (see heartbeat.lua)."""

    now_ms: int
    state: int  # 0: tasks ready; -1: none; N > 0: ms until a delayed task is due
    held: int  # processes Redis says the worker holds on the queue
    idle: bool  # whether the worker is in the queue's idle set
    idle_servers: int
    persistent: int = 0  # total weight of its persistent tasks (T; P with weights 1)
    servers: int = 1  # total capacity of its servers (C; S with capacities 1)
    release: tuple[str, ...] = ()  # processes a rebalance asks us to hand back
    capacity: int = 1  # the worker's capacity on the queue
    weight: int = 0  # the weight of the worker's processes there


@attrs.frozen
class HeartbeatReply:
    now_ms: int
    next_deadline_ms: int
    inbox: tuple[str, ...]
    queue_states: tuple[int, ...]
    held: tuple[int, ...]
    idle: tuple[bool, ...]
    idle_servers: tuple[int, ...]
    persistent: tuple[int, ...] = ()
    servers: tuple[int, ...] = ()
    release: tuple[tuple[str, ...], ...] = ()
    capacity: tuple[int, ...] = ()
    weight: tuple[int, ...] = ()

    def beats(self) -> list[QueueBeat]:
        """One :class:`QueueBeat` per queue named in the call, in its order."""
        per_queue = zip(
            self.queue_states,
            self.held,
            self.idle,
            self.idle_servers,
            self.persistent,
            self.servers,
            self.release,
            self.capacity,
            self.weight,
            strict=True,
        )
        return [QueueBeat(self.now_ms, *q) for q in per_queue]


@attrs.frozen
class HeartbeatRequest:
    """One worker's part of a ``heartbeat.lua`` call."""

    worker: str
    incarnation: str
    acks: tuple[str, ...] = ()  # process ids of cancels it has seen
    queues: tuple[str, ...] = ()  # the queues it serves, in the order beats() keeps


def parse_heartbeats(
    raw: Any,
    requests: Sequence[HeartbeatRequest],
    cache: dict[tuple[str, str], tuple[str, int, int, int, int]],
) -> list[outcome.Outcome[HeartbeatReply]]:
    """Split a ``heartbeat.lua`` reply into one outcome per worker; ``cache``
    keeps each (worker, queue)'s last balance (generation, T, C, capacity,
    extra weight), used when the reply says it still holds."""
    now, next_ms = int(raw[0]), int(raw[1])
    index: dict[str, int] = {}
    for r in requests:
        for q in r.queues:
            index.setdefault(q, len(index))
    idles = raw[2 : 2 + len(index)]
    # one flat list: each worker's part follows the last (heartbeat.lua)
    pos = 2 + len(index)
    out: list[outcome.Outcome[HeartbeatReply]] = []
    for r in requests:
        if isinstance(raw[pos], bytes):
            msg = raw[pos].decode()
            pos += 1
            out.append(outcome.Error(FencedError(msg.removeprefix("FENCED "))))
            continue
        n = int(raw[pos])
        inbox = tuple(x.decode() for x in raw[pos + 1 : pos + 1 + n])
        pos += 1 + n
        states, held, idle, release, shares = [], [], [], [], []
        for q in r.queues:
            states.append(int(raw[pos]))
            h = int(raw[pos + 1])
            held.append(h)
            idle.append(raw[pos + 2] == 1)
            pos += 3
            ids: tuple[str, ...] = ()
            if int(raw[pos]) == 0:
                pos += 1
                _, total, capacity, cap, extra = cache.get((r.worker, q), ("", 0, 1, 1, 0))
            else:
                gen, total, capacity, cap, extra, nrel = (int(x) for x in raw[pos + 1 : pos + 7])
                ids = tuple(x.decode() for x in raw[pos + 7 : pos + 7 + nrel])
                pos += 7 + nrel
                if gen >= 0:
                    cache[(r.worker, q)] = (str(gen), total, capacity, cap, extra)
                else:
                    cache.pop((r.worker, q), None)
            shares.append((total, capacity, cap, h + extra))
            release.append(ids)
        out.append(
            outcome.Value(
                HeartbeatReply(
                    now,
                    next_ms,
                    inbox,
                    tuple(states),
                    tuple(held),
                    tuple(idle),
                    tuple(int(idles[index[q]]) for q in r.queues),
                    tuple(x[0] for x in shares),
                    tuple(x[1] for x in shares),
                    tuple(release),
                    tuple(x[2] for x in shares),
                    tuple(x[3] for x in shares),
                )
            )
        )
    return out


@attrs.frozen
class ClaimReply:
    now_ms: int
    remaining: int
    processes: tuple[Process, ...]
    held_back: bool = False  # the fair share left persistent tasks for peers
    next_due_ms: int = -1  # ms until the first delayed task is due; -1: none


@attrs.frozen
class DelayReply:
    added: int  # payloads newly delayed (one delayed already keeps the earlier time)
    due_ms: int  # the due time, Redis clock
    now_ms: int


@attrs.frozen
class ResultsToKeep:
    """What a finish report keeps on a queue with a result TTL: per process
    id, its payload and what its handler returned (None, or bytes)."""

    ttl_ms: int
    values: Mapping[str, tuple[bytes, bytes | None]]


@attrs.frozen
class RecycleReply:
    alive: bool
    returned: int
    dead_lettered: int


class CrashDeadLetter(NamedTuple):
    """A task a recycle dead-lettered (its crashed worker's attempt was its
    last allowed one), for the recycler's log line."""

    queue: str
    head: bytes  # the payload's first 161 bytes
    attempts: int
    max_attempts: int
    worker: str  # the crashed worker


@attrs.frozen
class RecycleManyReply:
    """What one ``recycle.lua`` call did."""

    recycled: int  # workers that had anything left to recycle
    alive: list[str]  # workers found alive after all (left alone)
    returned: int  # processes handed back (or delayed)
    dead_lettered: int
    queues: list[str]  # the queues the call was given (learned ones included)
    dead: list[CrashDeadLetter] = attrs.Factory(list)  # the dead-lettered tasks


@attrs.frozen
class RebalanceReply:
    marked: int  # processes of peers marked to move to the caller
    persistent: int  # T, the total weight of the persistent tasks (P with weights 1)
    servers: int  # C, the total capacity of the servers (S with capacities 1)
    held: int  # the caller's held weight, what is on its way included


class ReapCheck(NamedTuple):
    now_ms: int
    next_ms: int  # until the earliest lease deadline still ahead; -1: none
    workers: int  # registered workers, live or not yet recycled
    dead: list[str]  # ids whose lease has run out


# How many argument sets Binding.claim_call and finish_call keep built.
_CLAIM_MEMO = 64

# A claim reply's processes are made without Process.__init__ (attrs' frozen
# __init__ sets each field through object.__setattr__, about a quarter of the
# cost of a claim reply): straight through the slots' descriptors, in the
# order of attrs.fields(Process) (tests/test_protocol.py checks that it
# builds what Process(...) does).
_PROCESS_SLOTS = ("id", "queue", "task", "token", "worker_id", "persistent", "attempts", "started")
_PROCESS_SET = tuple(getattr(Process, name).__set__ for name in _PROCESS_SLOTS)


def parse_claim(r: Any, queue: str, worker: str) -> ClaimReply:
    """A :class:`ClaimReply` from a ``claim.lua`` reply: {now ms, tasks left
    (-1: held back), ms until the next delayed task (-1: none), then per
    process its id, persistent flag, failed attempts and payload}.

    Raises:
        ValueError, TypeError, IndexError: the reply is not of that shape.
    """
    now = int(r[0])
    started = now / 1000
    procs: list[Process] = []
    append = procs.append
    new = object.__new__
    set_id, set_queue, set_task, set_token = _PROCESS_SET[:4]
    set_worker, set_persistent, set_attempts, set_started = _PROCESS_SET[4:]
    for pid, persistent, attempts, task in zip(r[3::4], r[4::4], r[5::4], r[6::4], strict=True):
        p = new(Process)
        set_id(p, pid.decode())
        set_queue(p, queue)
        set_task(p, task)
        set_token(p, int(pid))
        set_worker(p, worker)
        set_persistent(p, persistent == 1)
        set_attempts(p, int(attempts))
        set_started(p, started)
        append(p)
    left = int(r[1])
    return ClaimReply(now, max(left, 0), tuple(procs), held_back=left < 0, next_due_ms=int(r[2]))


def parse_claim_compact(r: Any, queue: str, worker: str) -> ClaimReply:
    """A :class:`ClaimReply` from the compact claim reply of
    ``finish_claim.lua`` (its finish flags taken off): {now ms, tasks left
    (-1: held back), ms until the next delayed task (-1: none), the first
    process id ("": none), c, mixed, the c payloads, then, if mixed, per
    process its persistent flag and failed attempts}; process i has id
    first + i.

    Raises:
        ValueError, TypeError, IndexError: the reply is not of that shape.
    """
    now = int(r[0])
    c = int(r[4])
    mixed = r[5] == 1
    if len(r) != 6 + c * (3 if mixed else 1):
        raise ValueError(f"a compact claim reply of {len(r)} items for {c} processes")
    procs: list[Process] = []
    if c:
        first = int(r[3])
        started = now / 1000
        append = procs.append
        new = object.__new__
        set_id, set_queue, set_task, set_token = _PROCESS_SET[:4]
        set_worker, set_persistent, set_attempts, set_started = _PROCESS_SET[4:]
        extra = r[6 + c :]
        for i, task in enumerate(r[6 : 6 + c]):
            token = first + i
            p = new(Process)
            set_id(p, str(token))
            set_queue(p, queue)
            set_task(p, task)
            set_token(p, token)
            set_worker(p, worker)
            if mixed:
                set_persistent(p, extra[2 * i] == 1)
                set_attempts(p, int(extra[2 * i + 1]))
            else:
                set_persistent(p, False)
                set_attempts(p, 0)
            set_started(p, started)
            append(p)
    left = int(r[1])
    return ClaimReply(now, max(left, 0), tuple(procs), held_back=left < 0, next_due_ms=int(r[2]))


class Binding:
    """Typed calls to the scripts of one namespace."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.scripts = load_scripts()
        # (worker, queue) -> (generation, T, C, capacity, extra held weight):
        # the balance a heartbeat last read with nothing moving or reserved
        self._balance: dict[tuple[str, str], tuple[str, int, int, int, int]] = {}
        # claim_call's arguments -> the call, built and packed once
        self._claims: dict[tuple[Any, ...], ScriptCall[ClaimReply]] = {}
        # (worker, incarnation, queue) -> finish.lua's keys and first arguments
        self._finishes: dict[tuple[str, str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {}
        # id(claim call) -> (the call, finish_claim.lua's command without the ids)
        self._finish_claims: dict[int, tuple[ScriptCall[ClaimReply], Packed]] = {}

    async def run(self, conn: Executor, call: ScriptCall[T]) -> T:
        """Send one built call (:meth:`claim_call`, :meth:`finish_call`) and
        parse its reply; raises what :func:`run_script` raises."""
        return call.parse(await run_script(conn, call.script, call.keys, call.args))

    async def _run(
        self, conn: Executor, name: str, keys: Sequence[str], args: Sequence[Any]
    ) -> Any:
        return await run_script(conn, self.scripts[name], keys, args)

    async def register(
        self, conn: Executor, worker: str, incarnation: str, ttl_ms: int, info: bytes
    ) -> int:
        k = self.keys
        keys = [k.heartbeat(worker), k.workers, k.info, k.version]
        return int(
            await self._run(
                conn, "register", keys, [worker, incarnation, ttl_ms, info, PROTOCOL_VERSION]
            )
        )

    async def serve(
        self, conn: Executor, worker: str, incarnation: str, queue: str, capacity: int = 1
    ) -> None:
        """Serve ``queue`` with ``capacity`` (its part of the fair share; see
        ``serve.lua``); serving again changes the capacity."""
        k = self.keys
        await self._run(
            conn,
            "serve",
            [k.heartbeat(worker), k.serves(worker), k.queues, k.servers(queue), k.share(queue)],
            [worker, incarnation, queue, capacity],
        )

    async def heartbeat(
        self,
        conn: Executor,
        worker: str,
        incarnation: str,
        ttl_ms: int,
        acks: Sequence[str],
        queues: Sequence[str],
    ) -> HeartbeatReply:
        """Renew one worker's lease (``heartbeat.lua`` with one worker).

        Raises:
            FencedError: its lease is gone or superseded (nothing written).
        """
        (one,) = await self.heartbeat_many(
            conn, ttl_ms, [HeartbeatRequest(worker, incarnation, tuple(acks), tuple(queues))]
        )
        return one.unwrap()

    async def heartbeat_many(
        self, conn: Executor, ttl_ms: int, requests: Sequence[HeartbeatRequest]
    ) -> list[outcome.Outcome[HeartbeatReply]]:
        """Renew the leases of several workers in one ``heartbeat.lua`` call
        (1 to 1,000 of them): each is fenced on its own.

        Returns:
            Per request, in order: ``outcome.Value`` of its reply, or
            ``outcome.Error(FencedError)`` for a worker whose lease is gone
            or superseded (nothing of it written; the others are renewed).
        Raises:
            MeshConnectionError, CommandError: for the whole call (then it is
                unknown which leases were renewed; renewing again is safe).
        """
        k = self.keys
        index: dict[str, int] = {}
        for r in requests:
            for q in r.queues:
                index.setdefault(q, len(index) + 1)
        keys = [k.workers]
        for q in index:
            keys += (k.queue(q), k.delayed(q), k.idle(q), k.moving(q))
            keys += (k.reserved(q), k.share(q), k.prio(q))
        # the generation of each queue's share last seen with nothing moving:
        # unchanged, the script reads nothing more of it (heartbeat.lua)
        cache = self._balance
        args: list[Any] = [ttl_ms, len(index), len(requests)]
        for r in requests:
            keys += (k.heartbeat(r.worker), k.inbox(r.worker))
            keys += [k.held(r.worker, q) for q in r.queues]
            args += (r.worker, r.incarnation, len(r.acks), *r.acks, len(r.queues))
            for q in r.queues:
                seen = cache.get((r.worker, q))
                args += (index[q], seen[0] if seen is not None else "")
        raw = await self._run(conn, "heartbeat", keys, args)
        return parse_heartbeats(raw, requests, cache)

    def claim_call(
        self,
        worker: str,
        incarnation: str,
        queue: str,
        n: int,
        max_attempts: int,
        *,
        fair: bool = False,
        backoff_ms: int = 1000,
        backoff_cap_ms: int = 60_000,
        ttl_ms: int = 0,
        wake: bool = True,
        rate: tuple[int, int] | None = None,
        patience_ms: int = 0,
    ) -> ScriptCall[ClaimReply]:
        """One ``claim.lua`` call. ``wake``: put the worker in the queue's idle
        set when it finds nothing (a runner waiting for work); False for a
        claim by hand, which nobody should wake. ``rate``: the queue's rate
        limit (claims, period ms), enforced by a token bucket in Redis.
        ``patience_ms`` (with ``fair``, at least 2): also take a persistent
        task beyond the fair share once it has had no owner for that long."""
        memo = (
            worker, incarnation, queue, n, max_attempts, fair, backoff_ms, backoff_cap_ms,
            ttl_ms, wake, rate, patience_ms,
        )  # fmt: skip
        call = self._claims.get(memo)
        if call is not None:
            return call
        k = self.keys
        keys = [
            k.heartbeat(worker),
            k.serves(worker),
            k.queue(queue),
            k.persistent(queue),
            k.procs(queue),
            k.held(worker, queue),
            k.attempts(queue),
            k.delayed(queue),
            k.token,
            k.servers(queue),
            k.standby(queue),
            k.idle(queue),
            k.reserved(queue),
            k.unowned(queue),
            k.share(queue),
            k.prio(queue),
            k.delayed_prio(queue),
        ]
        args = [
            worker,
            incarnation,
            queue,
            n,
            max_attempts,
            (patience_ms if patience_ms else 1) if fair else 0,
            backoff_ms,
            backoff_cap_ms,
            ttl_ms,
            1 if wake else 0,
            k.wake_prefix,
        ]
        # the rate bucket (its ARGV empty: no limit), then the pause flag
        keys += [k.rate(queue), k.paused(queue)]
        args += [rate[0], rate[1]] if rate is not None else ["", ""]

        # A runner claims with the same few argument sets over and over:
        # each is built and packed once (a handful per runner; the memo is
        # emptied should it ever grow large).
        parse = functools.partial(parse_claim, queue=queue, worker=worker)
        call = ScriptCall(self.scripts["claim"], keys, args, parse).reusable()
        if len(self._claims) >= _CLAIM_MEMO:
            self._claims.clear()
        self._claims[memo] = call
        return call

    async def claim(
        self,
        conn: Executor,
        worker: str,
        incarnation: str,
        queue: str,
        n: int,
        max_attempts: int,
        *,
        fair: bool = False,
        backoff_ms: int = 1000,
        backoff_cap_ms: int = 60_000,
        ttl_ms: int = 0,
        wake: bool = True,
        rate: tuple[int, int] | None = None,
        patience_ms: int = 0,
    ) -> ClaimReply:
        call = self.claim_call(
            worker,
            incarnation,
            queue,
            n,
            max_attempts,
            fair=fair,
            backoff_ms=backoff_ms,
            backoff_cap_ms=backoff_cap_ms,
            ttl_ms=ttl_ms,
            wake=wake,
            rate=rate,
            patience_ms=patience_ms,
        )
        return await self.run(conn, call)

    def finish_call(
        self,
        worker: str,
        incarnation: str,
        queue: str,
        ids: Sequence[str],
        results: ResultsToKeep | None = None,
    ) -> ScriptCall[list[bool]]:
        """A ``finish.lua`` call; with ``results`` (a queue that keeps them),
        a ``finish_results.lua`` call that keeps each id's result."""
        if results is not None:
            return self._finish_results_call(worker, incarnation, queue, ids, results)
        keys, head = self._finish_head(worker, incarnation, queue)
        return ScriptCall(self.scripts["finish"], keys, (*head, *ids), _parse_finish)

    def _finish_head(
        self, worker: str, incarnation: str, queue: str
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The keys and first arguments that ``finish.lua`` and
        ``finish_results.lua`` share, built once per (worker, incarnation,
        queue)."""
        memo = (worker, incarnation, queue)
        head = self._finishes.get(memo)
        if head is None:
            k = self.keys
            keys = (
                k.heartbeat(worker),
                k.procs(queue),
                k.held(worker, queue),
                k.persistent(queue),
                k.attempts(queue),
                k.share(queue),
                k.awaiting(queue),  # done messages only while someone awaits them
            )
            head = keys, (worker, incarnation, k.done_channel(queue))
            if len(self._finishes) >= _CLAIM_MEMO:
                self._finishes.clear()
            self._finishes[memo] = head
        return head

    def _finish_results_call(
        self,
        worker: str,
        incarnation: str,
        queue: str,
        ids: Sequence[str],
        results: ResultsToKeep,
    ) -> ScriptCall[list[bool]]:
        k = self.keys
        first, head = self._finish_head(worker, incarnation, queue)
        keys = list(first[:6])
        args: list[Any] = [*head, results.ttl_ms]
        for pid in ids:
            payload, value = results.values[pid]
            keys.append(k.result(queue, payload))
            args += [pid, "n" if value is None else "v", b"" if value is None else value]
        keys.append(first[6])  # the awaiting key, after the result keys
        return ScriptCall(self.scripts["finish_results"], keys, args, _parse_finish)

    async def finish(
        self,
        conn: Executor,
        worker: str,
        incarnation: str,
        queue: str,
        ids: Sequence[str],
        results: ResultsToKeep | None = None,
    ) -> list[bool]:
        return await self.run(conn, self.finish_call(worker, incarnation, queue, ids, results))

    async def finish_and_claim(
        self,
        conn: PipelineExecutor,
        worker: str,
        incarnation: str,
        queue: str,
        ids: Sequence[str],
        claim: ScriptCall[ClaimReply],
        results: ResultsToKeep | None = None,
    ) -> tuple[outcome.Outcome[list[bool]], outcome.Outcome[ClaimReply]]:
        """:meth:`finish` ``ids``, then ``claim`` (from :meth:`claim_call`), in
        one round trip. Redis runs the finish first, so the claim sees those
        processes gone (the fair share no longer counts them). Without
        ``results`` the two are one script call (``finish_claim.lua``): an
        error reply (fenced, not serving) means neither ran, and both
        outcomes are that error. With ``results`` they are two calls
        (``finish_results.lua`` and ``claim.lua``) in one write, not one
        atomic step, and either may fail alone.

        Returns:
            The outcome of each (see :func:`run_pipelined`): what
            :meth:`finish` and :meth:`run` of the claim would have returned
            or raised.
        Raises:
            MeshConnectionError: unknown whether either ran.
        """
        if results is not None:
            finish = self.finish_call(worker, incarnation, queue, ids, results)
            finished, claimed = await run_pipelined(conn, [finish, claim])
            return finished, claimed
        # One script (finish_claim.lua): one lease check and one call for
        # both. An error reply means neither ran; both take that error.
        # by the claim call's identity (claim_call's calls are memoised);
        # the entry keeps the call alive, so its id is not reused meanwhile
        memo = self._finish_claims.get(id(claim))
        if memo is None or memo[0] is not claim:
            if len(self._finish_claims) >= _CLAIM_MEMO:
                self._finish_claims.clear()
            keys = (*claim.keys, self.keys.awaiting(queue))
            args = (*claim.args, self.keys.done_channel(queue))
            script = self.scripts["finish_claim"]
            head = Packed(("EVALSHA", script.sha, len(keys), *keys, *args))
            memo = self._finish_claims[id(claim)] = (claim, head)
        head = memo[1]
        k = len(ids)
        try:
            # the command packed once but for the ids (Packed.extended)
            (reply,) = await conn.pipeline([head.extended(ids)], raise_on_error=False)
            if type(reply) is CommandError and reply.code == "NOSCRIPT":
                script = self.scripts["finish_claim"]
                (reply,) = await conn.pipeline(
                    [("EVAL", script.source, *head[2:], *ids)], raise_on_error=False
                )
            if isinstance(reply, CommandError):
                mapped = _map_error(reply)
                if mapped is not reply:
                    mapped.__cause__ = reply
                raise mapped
            flags = reply[len(reply) - k :]
            if len(flags) != k:
                raise ValueError(f"finish_claim replied {len(reply)} items for {k} ids")
            was_ours = [f == 1 for f in flags]
            took = parse_claim_compact(reply[: len(reply) - k], queue, worker)
        except MeshConnectionError:
            raise
        except Exception as exc:  # an error reply (neither ran), or a malformed one
            return outcome.Error(exc), outcome.Error(exc)
        return outcome.Value(was_ours), outcome.Value(took)

    async def give_back(
        self,
        conn: Executor,
        worker: str,
        queue: str,
        ids: Sequence[str],
        *,
        failed: bool,
        backoff_ms: int = 0,
        backoff_cap_ms: int = 0,
        errors: Sequence[str] | None = None,
        keep_ms: int = 0,
    ) -> list[tuple[int, int]]:
        """Per id: (outcome, delay ms); outcome 0 not ours, 1 front (or kept:
        with ``keep_ms`` > 0 and not failed, persistent tasks are reserved
        for ``worker`` for that long), 2 retry later, 3 dead.

        ``errors``: with ``failed``, the error of each id's attempt (kept in
        its dead-letter record if it is dead-lettered, and in the payload's
        attempt history, :meth:`Keys.tries`)."""
        k = self.keys
        keys = [
            k.procs(queue),
            k.held(worker, queue),
            k.queue(queue),
            k.persistent(queue),
            k.attempts(queue),
            k.delayed(queue),
            k.dead(queue),
            k.standby(queue),
            k.idle(queue),
            k.moving(queue),
            k.reserved(queue),
            k.unowned(queue),
            k.share(queue),
            k.prio(queue),
            k.delayed_prio(queue),
            k.tries(queue),
            k.tried(queue),
        ]
        keep = keep_ms > 0 and not failed
        args: list[Any] = [
            worker,
            "fail" if failed else "keep" if keep else "return",
            keep_ms if keep else backoff_ms,
            backoff_cap_ms,
            k.wake_prefix,
            queue,
        ]
        if failed and errors is not None:
            args += [
                f"{pid}\0{err}".encode(errors="replace")[: len(pid) + 1 + DEAD_ERROR_MAX]
                for pid, err in zip(ids, errors, strict=True)
            ]
        else:
            args += ids
        r = await self._run(conn, "give_back", keys, args)
        return [(int(r[i]), int(r[i + 1])) for i in range(0, len(r), 2)]

    async def drain(self, conn: Executor, worker: str, incarnation: str, queue: str) -> bool:
        """Begin a graceful stop of ``queue`` (``drain.lua``): ``worker`` stops
        being one of its servers (its capacity leaves the fair share) and
        keeps the processes it holds until it hands them back. Returns
        whether it served ``queue`` until now.

        Raises:
            FencedError: its lease is gone (nothing changed).
        """
        k = self.keys
        keys = [k.heartbeat(worker), k.servers(queue), k.idle(queue), k.share(queue)]
        return bool(await self._run(conn, "drain", keys, [worker, incarnation]))

    async def unserve(self, conn: Executor, worker: str, queue: str) -> int:
        k = self.keys
        keys = [
            k.serves(worker),
            k.held(worker, queue),
            k.procs(queue),
            k.queue(queue),
            k.persistent(queue),
            k.attempts(queue),
            k.dead(queue),
            k.servers(queue),
            k.delayed(queue),
            k.standby(queue),
            k.idle(queue),
            k.unowned(queue),
            k.share(queue),
            k.prio(queue),
            k.delayed_prio(queue),
        ]
        return int(await self._run(conn, "unserve", keys, [queue, k.wake_prefix, worker]))

    async def recycle(
        self,
        conn: Executor,
        worker: str,
        *,
        leave: bool,
        incarnation: str = "",
        queues: Iterable[str] = (),
    ) -> RecycleReply:
        """Recycle (``leave=False``, the worker must be dead) or retire
        (``leave=True``) one worker. Learns the worker's queues from the script
        when ``queues`` misses some; safe to call again after any failure."""
        r = await self._recycle(conn, [worker], "leave" if leave else "dead", incarnation, queues)
        return RecycleReply(bool(r.alive), r.returned, r.dead_lettered)

    async def recycle_dead(
        self, conn: Executor, workers: Sequence[str], *, queues: Iterable[str] = ()
    ) -> RecycleManyReply:
        """Recycle several dead workers in one script call (idle servers of a
        queue are woken once, however many they are). Workers found alive are left alone and
        listed in the reply. ``queues`` is a hint: the queues the workers
        serve that it misses cost one more call."""
        return await self._recycle(conn, workers, "dead", "", queues)

    async def _recycle(
        self,
        conn: Executor,
        workers: Sequence[str],
        mode: str,
        incarnation: str,
        queues: Iterable[str],
    ) -> RecycleManyReply:
        k = self.keys
        ws = list(dict.fromkeys(workers))
        qs = list(dict.fromkeys(queues))
        for _ in range(10):
            keys = [k.workers, k.info]
            for w in ws:
                keys += (k.heartbeat(w), k.serves(w), k.inbox(w))
            for q in qs:
                keys += (
                    k.procs(q),
                    k.queue(q),
                    k.persistent(q),
                    k.attempts(q),
                    k.dead(q),
                    k.servers(q),
                    k.delayed(q),
                    k.standby(q),
                    k.idle(q),
                    k.unowned(q),
                    k.share(q),
                    k.prio(q),
                    k.delayed_prio(q),
                )
            for w in ws:
                keys += (k.held(w, q) for q in qs)
            args = [mode, incarnation, k.wake_prefix, len(ws), *ws, *qs]
            r = await self._run(conn, "recycle", keys, args)
            if int(r[0]) == 0:
                return RecycleManyReply(
                    recycled=int(r[3]),
                    alive=[w.decode() for w in r[4]],
                    returned=int(r[1]),
                    dead_lettered=int(r[2]),
                    queues=qs,
                    dead=[
                        CrashDeadLetter(t[0].decode(), t[1], int(t[2]), int(t[3]), t[4].decode())
                        for t in r[5]
                    ],
                )
            qs += [q.decode() for q in r[1:]]
        raise ProtocolError(f"recycle of workers {ws}: their queues kept changing")

    async def rebalance(
        self,
        conn: Executor,
        worker: str,
        incarnation: str,
        queue: str,
        limit: int,
        hold_ms: int,
        servers: Sequence[str] = (),
    ) -> tuple[RebalanceReply, list[str]]:
        """Ask the peers above their fair share of ``queue`` to hand back
        their surplus, reserved for ``worker`` (``rebalance.lua``). Names the
        queue's servers as learned from Redis (called again when ``servers``
        was not the current set). Returns the reply and the servers."""
        k = self.keys
        names = list(servers)
        for _ in range(5):
            keys = [
                k.heartbeat(worker),
                k.servers(queue),
                k.persistent(queue),
                k.standby(queue),
                k.procs(queue),
                k.moving(queue),
                k.reserved(queue),
                k.queue(queue),
                k.share(queue),
                *(k.held(w, queue) for w in names),
            ]
            args = [worker, incarnation, queue, limit, hold_ms, k.wake_prefix, *names]
            r = await self._run(conn, "rebalance", keys, args)
            if int(r[0]) == 2:
                names = [x.decode() for x in r[1:]]
                continue
            return RebalanceReply(int(r[1]), int(r[2]), int(r[3]), int(r[4])), names
        raise CommandError("rebalance: the servers of the queue keep changing")

    async def reap_check(self, conn: Executor, limit: int = 100, lease_ms: int = 0) -> ReapCheck:
        """Which workers' leases have run out; with ``lease_ms``, the ids
        returned are hidden from other callers for that long."""
        r = await self._run(conn, "reap_check", [self.keys.workers], [limit, lease_ms])
        return ReapCheck(int(r[0]), int(r[1]), int(r[2]), [w.decode() for w in r[3:]])

    async def enqueue(
        self, conn: Executor, queue: str, payloads: Sequence[bytes], priority: int = 0
    ) -> int:
        k = self.keys
        keys = [k.queue(queue), k.queues, k.persistent(queue), k.standby(queue), k.idle(queue)]
        keys.append(k.prio(queue))
        args = [queue, k.wake_prefix, priority, *payloads]
        return int(await self._run(conn, "enqueue", keys, args))

    async def delay(
        self,
        conn: Executor,
        queue: str,
        payloads: Sequence[bytes],
        *,
        in_ms: int = 0,
        at_ms: int | None = None,
        priority: int = 0,
    ) -> DelayReply:
        """``delay.lua``: delay ``payloads`` by ``in_ms`` ms of the Redis clock,
        or until ``at_ms`` (ms since the epoch, Redis clock); when due they
        go to the front of level ``priority``."""
        k = self.keys
        keys = [k.delayed(queue), k.queues, k.persistent(queue), k.standby(queue), k.idle(queue)]
        keys.append(k.delayed_prio(queue))
        mode, ms = ("in", in_ms) if at_ms is None else ("at", at_ms)
        args = [queue, k.wake_prefix, mode, ms, priority, *payloads]
        r = await self._run(conn, "delay", keys, args)
        return DelayReply(int(r[0]), int(r[1]), int(r[2]))

    async def dead(
        self, conn: Executor, queue: str, mode: str, payloads: Sequence[bytes] | None
    ) -> tuple[int, int]:
        """``dead.lua``: requeue or purge dead letters (all, or those
        payloads; an empty list: none); (records acted on, records left:
        now persistent)."""
        if payloads is not None and not payloads:
            return 0, 0
        k = self.keys
        keys = [
            k.dead(queue),
            k.queue(queue),
            k.attempts(queue),
            k.persistent(queue),
            k.standby(queue),
            k.idle(queue),
        ]
        r = await self._run(conn, "dead", keys, [queue, k.wake_prefix, mode, *(payloads or ())])
        return int(r[0]), int(r[1])

    async def pause(self, conn: Executor, queue: str, mode: str) -> bool:
        """``pause.lua``: pause (mode ``pause``) or resume (``resume``) a
        queue; whether that changed anything."""
        k = self.keys
        keys = [k.paused(queue), k.queues, k.idle(queue), k.queue(queue), k.prio(queue)]
        return bool(await self._run(conn, "pause", keys, [mode, queue, k.wake_prefix]))

    async def stats(
        self, conn: Executor, counts: Mapping[str, tuple[int, int]], keep_minutes: int
    ) -> int:
        """``stats.lua``: add (finished, failed) per queue to the current
        minute of the Redis clock; the minute (since the epoch)."""
        k = self.keys
        keys = [k.stats(q) for q in counts]
        args: list[Any] = [keep_minutes]
        for done, failed in counts.values():
            args += [done, failed]
        return int(await self._run(conn, "stats", keys, args))

    async def configure(
        self, conn: Executor, queue: str, mode: str, source: str, fields: Sequence[Any]
    ) -> bytes | None:
        """``configure.lua``: the policy JSON stored afterwards (None after
        mode ``clear``)."""
        k = self.keys
        r = await self._run(conn, "configure", [k.policy, k.queues], [queue, mode, source, *fields])
        return r if isinstance(r, bytes) else None

    async def schedule(
        self, conn: Executor, queue: str, payload: bytes, spec: str, first_ms: int | None
    ) -> tuple[bool, int]:
        """``schedule.lua`` mode add: (new, first tick ms)."""
        k = self.keys
        r = await self._run(
            conn,
            "schedule",
            [k.schedules, k.schedule_specs, k.queues],
            ["add", queue, payload, spec, "" if first_ms is None else first_ms],
        )
        return r[0] == 1, int(r[1])

    async def unschedule(self, conn: Executor, queue: str, payload: bytes) -> bool:
        """``schedule.lua`` mode remove: whether it existed."""
        k = self.keys
        r = await self._run(
            conn,
            "schedule",
            [k.schedules, k.schedule_specs, k.queues],
            ["remove", queue, payload, "", ""],
        )
        return int(r) == 1

    async def fire(self, conn: Executor, ticks: Sequence[tuple[bytes, int, int]]) -> list[int]:
        """``fire.lua``: per (schedule id, tick read, next tick), 1 fired, 0
        not (another peer did), 2 skipped (now a persistent task)."""
        k = self.keys
        keys = [k.schedules, k.schedule_specs, k.queues]
        args: list[Any] = [k.wake_prefix]
        for sid, tick, nxt in ticks:
            q = sid.partition(b"\0")[0].decode()
            keys += [k.queue(q), k.persistent(q), k.standby(q), k.idle(q)]
            args += [sid, tick, nxt]
        return [int(x) for x in await self._run(conn, "fire", keys, args)]

    async def ensure(
        self, conn: Executor, queue: str, payloads: Sequence[bytes], weight: int = 1
    ) -> list[bool]:
        """Per payload: added (True) or a persistent task already (False);
        every one gets ``weight``."""
        k = self.keys
        keys = [k.queue(queue), k.queues, k.persistent(queue), k.standby(queue), k.idle(queue)]
        keys += [k.delayed(queue), k.unowned(queue), k.share(queue), k.procs(queue)]
        keys.append(k.prio(queue))
        r = await self._run(conn, "ensure", keys, [queue, k.wake_prefix, weight, *payloads])
        return [x == 1 for x in r]

    async def recount(self, conn: Executor, queue: str) -> tuple[int, int]:
        """Set ``queue``'s persistent weight sums to what its registry holds
        (``recount.lua``): (the weight counted before, the weight present)."""
        k = self.keys
        keys = [k.persistent(queue), k.standby(queue), k.share(queue)]
        was, now = await self._run(conn, "recount", keys, [queue])
        return int(was), int(now)

    async def cancel(self, conn: Executor, queue: str, payload: bytes) -> tuple[int, int]:
        """(queued copies removed, running processes cancelled)."""
        k = self.keys
        keys = [k.queue(queue), k.persistent(queue), k.procs(queue), k.attempts(queue)]
        keys += [k.delayed(queue), k.standby(queue), k.reserved(queue), k.unowned(queue)]
        keys += [k.share(queue), k.prio(queue), k.delayed_prio(queue)]
        return await self._cancelling(conn, "cancel", queue, keys, [payload, k.cancel_prefix])

    async def delete_queue(self, conn: Executor, queue: str) -> tuple[int, int]:
        """(queued, delayed and dead-lettered tasks removed, running processes
        cancelled)."""
        k = self.keys
        keys = [k.queue(queue), k.persistent(queue), k.procs(queue), k.attempts(queue)]
        keys += [k.delayed(queue), k.dead(queue), k.queues, k.standby(queue)]
        keys += [k.moving(queue), k.reserved(queue), k.unowned(queue), k.share(queue)]
        keys += [k.prio(queue), k.delayed_prio(queue)]
        args = [queue, k.cancel_prefix, k.delete_channel(queue)]
        return await self._cancelling(conn, "delete_queue", queue, keys, args)

    async def _cancelling(
        self, conn: Executor, name: str, queue: str, keys: list[str], args: list[Any]
    ) -> tuple[int, int]:
        """Run a script that cancels running processes of ``queue``: it needs
        the held and inbox keys of their workers, and names the workers whose
        keys it was not given (then nothing changed); call again with them."""
        k = self.keys
        workers: list[str] = []
        for _ in range(10):
            wkeys = [key for w in workers for key in (k.held(w, queue), k.inbox(w))]
            r = await self._run(conn, name, keys + wkeys, args + workers)
            if int(r[0]) == 0:
                return int(r[1]), int(r[2])
            workers += [w.decode() for w in r[1:]]
        raise ProtocolError(f"{name} on queue {queue}: the running processes kept changing")


#: The error kept in a dead-letter record is cut to this many bytes.
DEAD_ERROR_MAX = 2000


def parse_dead(rec: bytes, queue: str) -> DeadLetter:
    """A :class:`DeadLetter` from an entry of ``{ns}:dead:<Q>``.

    Raises:
        ProtocolError: the entry is not of the documented shape.
    """
    parts = rec.split(b"\0", 4)
    try:
        when, attempts, worker, error, payload = parts
        return DeadLetter(
            payload,
            int(attempts),
            error.decode(errors="replace"),
            worker.decode(errors="replace"),
            int(when) / 1000,
        )
    except ValueError:
        raise ProtocolError(f"malformed dead-letter record of queue {queue}") from None


def parse_result(rec: bytes, payload: bytes) -> tuple[float, bytes | None] | None:
    """(when, value) of a result record (``finish_results.lua``), or None if
    the record is of another payload (a SHA-1 collision) or malformed."""
    parts = rec.split(b"\0", 4)
    if len(parts) != 5 or parts[0] not in (b"v", b"n"):
        return None
    try:
        when, size = int(parts[1]), int(parts[3])
    except ValueError:
        return None
    rest = parts[4]
    if rest[size:] != payload:
        return None
    return when / 1000, (rest[:size] if parts[0] == b"v" else None)


def _parse_finish(r: Any) -> list[bool]:
    return [x == 1 for x in r]


# A process record's kind: persistent, one-shot, one-shot with a priority.
_KINDS = frozenset([b"p", b"o", *(f"o{i}".encode() for i in range(1, 10))])


def parse_record(pid: bytes, rec: bytes, queue: str) -> Process:
    """A :class:`Process` from a field and value of ``{ns}:procs:<Q>``.

    Raises:
        ProtocolError: the record is not of the documented shape.
    """
    parts = rec.split(b"\0", 8)
    if len(parts) != 9 or parts[1] not in _KINDS:
        raise ProtocolError(f"malformed process record for process {pid!r} of queue {queue}")
    p = int(pid)
    return Process(
        str(p),
        queue,
        parts[8],
        p,
        parts[0].decode(),
        parts[1] == b"p",
        int(parts[2]),
        int(parts[7]) / 1000,
    )
