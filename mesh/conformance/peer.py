"""The Python peer of the conformance line protocol (protocol/conformance/README.md).

Run as ``python -m mesh.conformance.peer`` (``--loop asyncio`` to run it on
asyncio; trio by default): it reads its Redis URL and namespace from
``MESH_REDIS_URL`` and ``MESH_NAMESPACE``, commands from stdin, and writes
events to stdout, one JSON object per line. Logs go to stderr.

Exit status: 0 after ``stop`` (or EOF), 3 when it cannot join (``VERSION``: the
namespace holds another protocol version; ``JOIN``: anything else), 2 on a bad
command line or environment.

Why a handler stopped (the ``reason`` of a ``stop`` event) is found when it
is cancelled, before it exits (so before the process can be handed back):
``stopped`` while this peer stops, ``fenced`` when the worker gave up its
lease (``Worker.check_lease``), ``moved`` when a rebalance marked the process
(``{ns}:moving:<Q>``) or Redis still holds it, ``cancelled`` when a cancel
removed it from ``{ns}:procs:<Q>``; ``timeout`` when Redis still holds it
and it ran for at least the queue's policy timeout.

Tokens are written as strings of decimal digits (a JSON number cannot hold
every 64-bit token in every language); error events carry the codes of the
protocol (protocol/conformance/README.md, "Error codes").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Any

import anyio
import anyio.abc

import mesh
from mesh._blob import BLOB_MIN
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh._loop import run
from mesh._scripts import load_scripts
from mesh.conformance._vectors import TIME_PRELUDE, text

SCRIPT_CODES = frozenset(
    {"FENCED", "DUPLICATE_WORKER", "VERSION", "CONFLICT", "NOT_SERVING", "BAD_ARG", "OOM"}
)
"""The error codes of the scripts (protocol/README.md, "Error codes")."""

log = logging.getLogger("mesh.conformance.peer")

EXIT_USAGE = 2
EXIT_JOIN = 3


class Peer:
    """One peer process: at most one worker, driven by stdin commands."""

    def __init__(self, url: str, namespace: str) -> None:
        self.url = url
        self.namespace = namespace
        self.keys = Keys(namespace)
        self.worker: mesh.Worker | None = None
        self.stopping = False
        self.exit_code = 0
        self._stop = anyio.Event()
        self._ready = anyio.Event()
        self._stack: contextlib.AsyncExitStack | None = None
        self._conn: Connection | None = None

    def emit(self, **event: Any) -> None:
        sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
        sys.stdout.flush()

    async def run(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            self._stack = stack
            async with anyio.create_task_group() as nursery:
                nursery.start_soon(self._read_commands, nursery)

    async def _script(self, cmd: dict[str, Any]) -> None:
        """The ``script`` command: run one script by name, expanded by this
        peer's loader, with the time prelude of the vectors before it."""
        script = load_scripts().get(str(cmd.get("name")))
        if script is None:
            raise mesh.ConfigError(f"script: no script named {cmd.get('name')!r}")
        s, us = (int(x) for x in cmd["time"])
        keys, args = list(cmd["keys"]), list(cmd["args"])
        if self._conn is None:
            assert self._stack is not None
            self._conn = await self._stack.enter_async_context(open_connection(self.url))
        source = (TIME_PRELUDE % {"s": s, "us": us}).encode() + script.source
        try:
            reply = await self._conn.execute("EVAL", source, len(keys), *keys, *args)
        except mesh.CommandError as exc:
            self.emit(event="ack", op="script", sha1=script.sha, error=str(exc))
            return
        self.emit(event="ack", op="script", sha1=script.sha, reply=text(reply))

    async def _read_commands(self, nursery: anyio.abc.TaskGroup) -> None:
        # stdin, read in a worker thread: the same on both loops
        stream = anyio.wrap_file(os.fdopen(os.dup(0), "rb", buffering=0))
        buf = b""
        async with stream:
            while True:
                data = await stream.read(65536)
                if not data:
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        if not await self._command(line, nursery):
                            return
        await self._command(b'{"op":"stop"}', nursery)

    async def _command(self, line: bytes, nursery: anyio.abc.TaskGroup) -> bool:
        """Run one command; False once the peer is done."""
        try:
            cmd = json.loads(line)
            op = cmd["op"]
        except (ValueError, KeyError, TypeError):
            self.emit(
                event="error", op=None, code="BAD_COMMAND", message=f"not a command: {line!r}"
            )
            return True
        try:
            if op == "script":
                await self._script(cmd)
                return True
            if op == "start":
                if self.worker is not None:
                    raise mesh.ConfigError("a worker is started already")
                await nursery.start(self._run_worker, float(cmd.get("ttl", 3.0)))
                if self.worker is None:  # it could not join
                    return False
                return True
            if op == "stop":
                await self._stop_worker()
                self.emit(event="stopped")
                nursery.cancel_scope.cancel()
                return False
            worker = self.worker
            if worker is None:
                raise mesh.ConfigError(f"{op}: no worker (send start first)")
            client = worker.client
            queue = cmd.get("queue")
            if op == "serve":
                await worker.start_work(
                    queue, self._handler(cmd["handler"]), concurrency=int(cmd["concurrency"])
                )
                self.emit(event="ack", op="serve", queue=queue)
            elif op == "enqueue":
                tasks = cmd["tasks"]
                if "size" in cmd:  # each padded to that many bytes: a big payload
                    tasks = [padded(str(t), int(cmd["size"])) for t in tasks]
                added = await client.enqueue_many(queue, tasks, group=cmd.get("group"))
                self.emit(event="ack", op="enqueue", added=_count(added))
            elif op == "ensure":
                flags = await client.ensure_many(queue, cmd["tasks"])
                self.emit(event="ack", op="ensure", added=sum(flags))
            elif op == "cancel":
                found = await client.cancel(queue, cmd["task"])
                self.emit(event="ack", op="cancel", found=found > 0)
            elif op == "reconcile":
                r = await client.reconcile(queue, cmd["tasks"])
                self.emit(
                    event="ack", op="reconcile", added=len(r.added), cancelled=len(r.cancelled)
                )
            else:
                self.emit(event="error", op=op, code="BAD_COMMAND", message=f"unknown op {op!r}")
        except mesh.MeshError as exc:
            self.emit(event="error", op=op, code=error_code(exc), message=str(exc))
        except (KeyError, TypeError, ValueError) as exc:
            self.emit(event="error", op=op, code="BAD_COMMAND", message=f"{op}: {exc!r}")
        return True

    async def _run_worker(self, ttl: float, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            async with mesh.open_worker(self.url, namespace=self.namespace, ttl=ttl) as worker:
                self.worker = worker
                self.emit(event="ready", worker=worker.id, version=mesh.PROTOCOL_VERSION)
                task_status.started()
                async with anyio.create_task_group() as watch:
                    watch.start_soon(self._watch_fences, worker)
                    await self._stop.wait()
                    watch.cancel_scope.cancel()
                self.stopping = True
        except mesh.ProtocolError as exc:
            self._refuse("VERSION", exc, task_status)
        except mesh.MeshError as exc:
            if self.worker is not None:
                raise
            self._refuse("JOIN", exc, task_status)
        finally:
            self._ready.set()

    def _refuse(self, code: str, exc: Exception, task_status: anyio.abc.TaskStatus[None]) -> None:
        self.emit(event="error", op="start", code=code, message=str(exc))
        self.exit_code = EXIT_JOIN
        task_status.started()

    async def _stop_worker(self) -> None:
        if self.worker is None:
            return
        self.stopping = True
        self._stop.set()
        await self._ready.wait()

    async def _watch_fences(self, worker: mesh.Worker) -> None:
        """Report each identity the worker gave up (a self-fence or a lost lease)."""
        last = worker.id
        while True:
            await anyio.sleep(0.02)
            if worker.id != last:
                self.emit(event="fenced", worker=last)
                last = worker.id

    def _handler(self, spec: Any) -> mesh.Handler:
        if spec not in ("hold", "done", "fail", "echo") and not (
            isinstance(spec, dict) and isinstance(spec.get("sleep"), int | float)
        ):
            raise mesh.ConfigError(f"unknown handler {spec!r}")

        async def handler(p: mesh.Process) -> bytes | None:
            task = task_text(p.task)
            token = str(p.token)
            began = anyio.current_time()
            self.emit(event="start", queue=p.queue, task=task, token=token, worker=p.worker_id)
            try:
                if spec == "hold":
                    await anyio.sleep_forever()
                elif isinstance(spec, dict):
                    await anyio.sleep(float(spec["sleep"]))
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    reason = await self._why_stopped(p, anyio.current_time() - began)
                self.emit(event="stop", queue=p.queue, task=task, token=token, reason=reason)
                raise
            if spec == "fail":
                self.emit(event="done", queue=p.queue, task=task, token=token, ok=False)
                raise RuntimeError("conformance failure")
            self.emit(event="done", queue=p.queue, task=task, token=token, ok=True)
            return p.task if spec == "echo" else None

        return handler

    async def _why_stopped(self, p: mesh.Process, ran: float) -> str:
        worker = self.worker
        if self.stopping or worker is None:
            return "stopped"
        try:
            worker.check_lease(p)
        except mesh.FencedError:
            return "fenced"
        conn = worker._conn
        try:
            with anyio.fail_after(2.0):
                marked, held, policy = await conn.pipeline(
                    [
                        ("HEXISTS", self.keys.moving(p.queue), p.id),
                        ("HEXISTS", self.keys.procs(p.queue), p.id),
                        ("HGET", self.keys.policy, p.queue),
                    ]
                )
        except (mesh.MeshError, TimeoutError):
            return "fenced"
        if marked:
            return "moved"
        if held:
            timeout = json.loads(policy).get("timeout_ms", 0) / 1000 if policy else 0
            return "timeout" if 0 < timeout <= ran + 0.001 else "moved"
        return "cancelled"


def error_code(exc: mesh.MeshError) -> str:
    """The line protocol's code of an error: the script's code when Redis
    answered with one, else what kind of failure it was."""
    first = str(exc).split(" ", 1)[0]
    if first in SCRIPT_CODES:
        return first
    if isinstance(exc, mesh.ProtocolError):
        return "VERSION"
    if isinstance(exc, mesh.ConflictError):
        return "CONFLICT"
    if isinstance(exc, mesh.FencedError):
        return "FENCED"
    if isinstance(exc, mesh.MeshConnectionError):
        return "CONNECTION"
    if isinstance(exc, mesh.CommandError):
        return "OOM" if isinstance(exc, mesh.OutOfMemoryError) else "ERROR"
    if isinstance(exc, mesh.ConfigError):
        return "BAD_COMMAND"
    return "ERROR"


def padded(task: str, size: int) -> bytes:
    """A task of an enqueue with ``size``: ``task`` padded with ``.`` bytes to
    ``size`` bytes (a payload of more than 1 MiB is stored out of line)."""
    b = task.encode()
    return b + b"." * max(0, size - len(b))


def task_text(payload: bytes) -> str:
    """A payload as events name it: its text; one of more than 1 MiB (a
    padded task) by its text before its first ``.``."""
    if len(payload) > BLOB_MIN:
        return payload.split(b".", 1)[0].decode()
    return payload.decode()


def _count(added: object) -> int:
    if isinstance(added, int):
        return added
    if isinstance(added, list | tuple):
        return sum(1 for a in added if a)
    return 0


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    url = os.environ.get("MESH_REDIS_URL")
    namespace = os.environ.get("MESH_NAMESPACE")
    if not url or not namespace:
        print("mesh.conformance.peer: set MESH_REDIS_URL and MESH_NAMESPACE", file=sys.stderr)
        return EXIT_USAGE
    loop = "trio"
    if sys.argv[1:] in (["--loop", "asyncio"], ["--loop", "trio"]):
        loop = sys.argv[2]
    elif sys.argv[1:]:
        print("usage: python -m mesh.conformance.peer [--loop trio|asyncio]", file=sys.stderr)
        return EXIT_USAGE
    peer = Peer(url, namespace)
    run(loop, peer.run)
    return peer.exit_code


if __name__ == "__main__":
    sys.exit(main())
