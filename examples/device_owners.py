"""Exactly one owner per device connection, with fencing tokens.

A fleet of devices accepts one session per device. Several peers (real OS
processes) hold the sessions as persistent tasks of the queue ``devices``:
the mesh gives each device one live owner, and moves it when its owner dies.
Every session and every command carries the owner's fencing token, and the
device refuses a token lower than the highest it has seen, so an owner that
was paused and comes back late cannot act.

The run:

1. Start a fake device server (in this process) and four peer processes.
2. Ensure six devices: each gets one owner, which opens a session and polls.
3. SIGKILL the peer that holds the most devices. Its sessions die with it;
   after the lease TTL a live peer takes each device over, with a higher token.
4. Make another peer stop itself (SIGSTOP) in the middle of a command, at the
   worst moment: after deciding to send, before sending. Its lease runs out
   and peers take its devices over. Then SIGCONT it. Before its event loop
   gets round to noticing that its fence deadline has passed, the handler
   that was stopped, and any other handler that was already due to run,
   takes one more step: those commands reach the devices with old tokens
   and are rejected. At its next checkpoint every handler of the paused peer
   is cancelled (it had no confirmed heartbeat for too long), and the peer
   rejoins the mesh under a new worker id.
5. Delete the queue (every session is cancelled where it runs), stop the
   peers with SIGTERM, and check the device server's log: no two sessions of
   one device ever acted at once, and the stale command was rejected.

Run it::

    python examples/device_owners.py            # embedded redis-server
    MESH_REDIS_URL=redis://host:port python examples/device_owners.py

It exits 0 when the checks hold, 1 when they do not.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable

import _support
import attrs
import trio

import mesh

QUEUE = "devices"
PER_PEER = 3  # how many devices one peer may own at once
COMMAND_INTERVAL = 0.1  # seconds between two commands of one session
MAX_LINE = 1024

# --------------------------------------------------------------------------
# The device server: a fake fleet of devices behind one TCP port.
# --------------------------------------------------------------------------


@attrs.frozen
class Entry:
    """One line of the device server's log.

    Attributes:
        at: seconds since the server started.
        device: the device name.
        session: the session number (1, 2, ... in order of connection).
        token: the fencing token the session presented.
        peer: the worker id the session said it came from.
        event: ``session`` (opened), ``refused`` (HELLO with a stale token),
            ``accepted`` / ``rejected`` (a command), ``closed``.
        detail: the command text, or why it was rejected or closed.
    """

    at: float
    device: str
    session: int
    token: int
    peer: str
    event: str
    detail: str = ""


@attrs.define
class Session:
    """A device session as the server sees it."""

    number: int
    device: str
    token: int
    peer: str
    closed: bool = False
    accepted: int = 0


class DeviceRejected(Exception):
    """The device refused a session or a command (a stale fencing token)."""


class DeviceServer:
    """A fake device fleet on 127.0.0.1 that fences by token.

    Line protocol (ASCII, one line each way per request)::

        HELLO <device> <token> <peer>  ->  OK | REJECT <why>   (and closes)
        CMD <token> <text>             ->  OK | REJECT <why>   (and closes)

    A session (HELLO) is refused if its token is lower than the highest token
    the device has seen. A session with a higher token supersedes the current
    one: from then on the device has one session, the new one, and a command
    on the old session is rejected (its token is now lower than the highest
    seen). Every event goes to :attr:`entries` and to ``on_entry``.

    Args:
        on_entry: called (synchronously) with every new log entry.
    """

    def __init__(self, on_entry: Callable[[Entry], None] | None = None) -> None:
        self.entries: list[Entry] = []
        self.highest: dict[str, int] = {}
        self.current: dict[str, Session] = {}
        self.port = 0
        self._on_entry = on_entry
        self._sessions = 0
        self._t0 = 0.0

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on a free port of 127.0.0.1 until cancelled; ``nursery.start``
        returns the port."""
        self._t0 = trio.current_time()
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = int(listeners[0].socket.getsockname()[1])
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    def connected(self, device: str) -> Session | None:
        """The device's current session, if it is still open."""
        s = self.current.get(device)
        return s if s is not None and not s.closed else None

    def _log(self, s: Session, event: str, detail: str = "", token: int | None = None) -> None:
        e = Entry(
            trio.current_time() - self._t0,
            s.device,
            s.number,
            s.token if token is None else token,
            s.peer,
            event,
            detail,
        )
        self.entries.append(e)
        if self._on_entry is not None:
            self._on_entry(e)

    async def _handle(self, stream: trio.SocketStream) -> None:
        lines = LineReader(stream)
        session: Session | None = None
        try:
            hello = (await lines.read()).split(" ")
            if len(hello) != 4 or hello[0] != "HELLO" or not hello[2].isdigit():
                await stream.send_all(b"REJECT bad HELLO\n")
                return
            self._sessions += 1
            session = Session(self._sessions, hello[1], int(hello[2]), hello[3])
            highest = self.highest.get(session.device, 0)
            if session.token < highest:
                why = f"stale token {session.token} < {highest}"
                self._log(session, "refused", why)
                session.closed = True
                session = None
                await stream.send_all(f"REJECT {why}\n".encode())
                return
            old = self.current.get(session.device)
            self.highest[session.device] = session.token
            self.current[session.device] = session
            detail = f"supersedes session {old.number}" if old and not old.closed else ""
            self._log(session, "session", detail)
            await stream.send_all(b"OK\n")
            while True:
                words = (await lines.read()).split(" ", 2)
                if len(words) != 3 or words[0] != "CMD" or not words[1].isdigit():
                    await stream.send_all(b"REJECT bad CMD\n")
                    return
                token, text = int(words[1]), words[2]
                highest = self.highest[session.device]
                if token != session.token:
                    why = f"token {token} is not this session's ({session.token})"
                elif token < highest:
                    why = f"stale token {token} < {highest}"
                else:
                    session.accepted += 1
                    self._log(session, "accepted", text)
                    await stream.send_all(b"OK\n")
                    continue
                self._log(session, "rejected", f"{text!r}: {why}", token=token)
                await stream.send_all(f"REJECT {why}\n".encode())
                return
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if session is not None and not session.closed:
                session.closed = True
                self._log(session, "closed")
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)


class LineReader:
    """Read newline-terminated ASCII lines from a trio stream."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buf = bytearray()

    async def read(self) -> str:
        """The next line, without its newline.

        Raises:
            EOFError: the peer closed the stream before a whole line came.
            ValueError: a line longer than ``MAX_LINE`` bytes.
        """
        while (i := self._buf.find(b"\n")) < 0:
            if len(self._buf) > MAX_LINE:
                raise ValueError("line too long")
            data = await self._stream.receive_some(4096)
            if not data:
                raise EOFError("connection closed")
            self._buf += data
        line = bytes(self._buf[:i])
        del self._buf[: i + 1]
        return line.decode("ascii", errors="replace")


class DeviceSession:
    """A client session with one device, under one fencing token. Get one
    from :meth:`open`; close it with ``async with`` or :meth:`aclose`."""

    def __init__(self, stream: trio.SocketStream, device: str, token: int) -> None:
        self.device = device
        self.token = token
        self._stream = stream
        self._lines = LineReader(stream)

    @classmethod
    async def open(cls, port: int, device: str, token: int, peer: str) -> DeviceSession:
        """Connect to the device server on 127.0.0.1:``port`` and open a
        session with ``device``.

        Raises:
            DeviceRejected: the device has seen a higher token.
            OSError: the server cannot be reached.
        """
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        try:
            await stream.send_all(f"HELLO {device} {token} {peer}\n".encode())
            reply = await LineReader(stream).read()
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        if reply != "OK":
            await trio.aclose_forcefully(stream)
            raise DeviceRejected(f"{device}: {reply}")
        return cls(stream, device, token)

    async def command(self, text: str) -> None:
        """Send one command under this session's token and wait for the answer.

        Raises:
            DeviceRejected: the device refused it (a newer owner exists).
            EOFError, trio.BrokenResourceError: the connection broke.
        """
        await self._stream.send_all(f"CMD {self.token} {text}\n".encode())
        reply = await self._lines.read()
        if reply != "OK":
            raise DeviceRejected(f"{self.device}: {reply}")

    async def aclose(self) -> None:
        """Close the connection (the device logs the session as closed)."""
        await trio.aclose_forcefully(self._stream)

    async def __aenter__(self) -> DeviceSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# --------------------------------------------------------------------------
# A peer: one worker process that owns device sessions.
# --------------------------------------------------------------------------


async def peer(url: str, namespace: str, name: str, port: int, ttl: float) -> None:
    """Serve the ``devices`` queue until SIGTERM or SIGINT; SIGUSR1 makes the
    next command stop this process (SIGSTOP) just before it is sent."""
    pause_requested = False

    async def hold_device(process: mesh.Process) -> None:
        nonlocal pause_requested
        device = process.task.decode()
        session = await DeviceSession.open(port, device, process.token, process.worker_id)
        async with session:
            n = 0
            while True:
                n += 1
                if pause_requested:
                    pause_requested = False
                    # A stop-the-world pause (GC, swapped out, a blocking call,
                    # a VM migration) between deciding to act and acting.
                    os.kill(os.getpid(), signal.SIGSTOP)
                await session.command(f"poll {n}")
                await trio.sleep(COMMAND_INTERVAL)

    with trio.open_signal_receiver(signal.SIGUSR1, signal.SIGTERM, signal.SIGINT) as signals:
        async with mesh.open_worker(url, namespace=namespace, ttl=ttl, worker_id=name) as worker:
            await worker.start_work(QUEUE, hold_device, concurrency=PER_PEER)
            async for signum in signals:
                if signum == signal.SIGUSR1:
                    pause_requested = True
                else:
                    break
        # Leaving open_worker cancelled every handler (closing its session)
        # and handed every device back to the queue for the other peers.


# --------------------------------------------------------------------------
# The run: start everything, kill one peer, pause another, check the log.
# --------------------------------------------------------------------------


@attrs.frozen
class Report:
    """What the run saw.

    Attributes:
        killed, paused: the peers that were killed and paused.
        kill_takeover: seconds from the SIGKILL until every device of the
            killed peer had a new session.
        pause_takeover: seconds from the pause until every device of the
            paused peer had a new session.
        rejected: the commands the devices rejected.
        overlaps: how often a session acted after a newer session of the same
            device had acted (must be 0).
        rejoined_as: the paused peer's new worker id.
        exit_codes: per peer, its exit code (-9 for the killed one).
        entries: the device server's whole log.
    """

    killed: str
    paused: str
    kill_takeover: float
    pause_takeover: float
    rejected: tuple[Entry, ...]
    overlaps: int
    rejoined_as: str
    exit_codes: dict[str, int]
    entries: tuple[Entry, ...]

    @property
    def ok(self) -> bool:
        """No two sessions acted at once, the stale command was rejected, and
        every peer that was not killed exited 0."""
        stopped = [c for name, c in self.exit_codes.items() if name != self.killed]
        return (
            self.overlaps == 0
            and any(e.peer == self.paused for e in self.rejected)
            and all(c == 0 for c in stopped)
        )


def count_overlaps(entries: list[Entry] | tuple[Entry, ...]) -> int:
    """Count accepted commands of a session that come after an accepted
    command of a newer session (higher token) of the same device. Zero means
    the sessions of each device acted one after the other, never at once."""
    newest: dict[str, int] = {}
    overlaps = 0
    for e in entries:
        if e.event != "accepted":
            continue
        if e.token < newest.get(e.device, -1):
            overlaps += 1
        newest[e.device] = max(newest.get(e.device, -1), e.token)
    return overlaps


def describe(e: Entry) -> str:
    """One line for the narration of a device server event."""
    who = f"session {e.session} of {e.peer} (token {e.token})"
    if e.event == "session":
        extra = f", {e.detail}" if e.detail else ""
        return f"device {e.device}: {who} opened{extra}"
    if e.event == "closed":
        return f"device {e.device}: {who} closed"
    return f"device {e.device}: {e.event.upper()} {e.detail} from {who}"


async def run(
    url: str,
    *,
    namespace: str = "example-devices",
    peers: int = 4,
    devices: int = 6,
    ttl: float = 1.0,
    say: Callable[[str], None] | None = None,
) -> Report:
    """Run the scenario of the module docstring against Redis at ``url`` and
    return what it saw. Every peer process is gone when it returns.

    Raises:
        TimeoutError: something did not happen in time (the peers are stopped).
    """
    narrate = _support.Narrator(say)
    names = [f"peer-{chr(ord('A') + i)}" for i in range(peers)]
    device_names = [f"dev-{i + 1}" for i in range(devices)]
    chatty = {"session", "refused", "rejected", "closed"}
    server = DeviceServer(lambda e: narrate(describe(e)) if e.event in chatty else None)
    procs: dict[str, trio.Process] = {}
    within = 5 * ttl + 5

    async with trio.open_nursery() as nursery, mesh.open_client(url, namespace=namespace) as client:
        port = await nursery.start(server.serve)
        narrate(f"device server listening on 127.0.0.1:{port}")
        await client.delete_queue(QUEUE)  # whatever an earlier run left behind
        try:
            for name in names:
                procs[name] = await trio.lowlevel.open_process(
                    [
                        *(sys.executable, __file__, "peer", "--redis", url),
                        *("--namespace", namespace, "--name", name),
                        *("--device-port", str(port), "--ttl", str(ttl)),
                    ],
                    stdin=subprocess.DEVNULL,
                )

            async def all_ready() -> bool:
                ws = await client.workers()
                return sum(w.alive and QUEUE in w.queues for w in ws) == peers

            await _support.wait_until(all_ready, within=within + 10, what="the peers to start")
            narrate(
                f"{peers} peers up ({', '.join(names)}), ttl {ttl:g} s, "
                f"at most {PER_PEER} devices each"
            )
            await client.ensure_many(QUEUE, device_names)
            narrate(f"ensured {devices} persistent tasks: {', '.join(device_names)}")

            async def all_acting(at_least: int = 3) -> bool:
                return all(
                    (s := server.connected(d)) is not None and s.accepted >= at_least
                    for d in device_names
                )

            await _support.wait_until(all_acting, within=within, what="every device to be held")
            owners = _owners(server, device_names)
            narrate("owners: " + _owner_line(owners))

            # -- 1. a peer dies without warning ------------------------------
            victim = max(names, key=lambda n: (len(owners.get(n, [])), n))
            moved = {d: server.current[d].token for d in owners[victim]}
            procs[victim].kill()
            killed_at = trio.current_time()
            narrate(f"SIGKILL {victim} (it held {', '.join(moved)})")

            async def taken_over(old: dict[str, int]) -> bool:
                return all(
                    (s := server.connected(d)) is not None and s.token > t and s.accepted >= 3
                    for d, t in old.items()
                )

            await _support.wait_until(
                lambda: taken_over(moved), within=within, what="the killed peer's devices to move"
            )
            kill_takeover = trio.current_time() - killed_at
            narrate(
                f"all devices of {victim} moved {kill_takeover:.2f} s after the SIGKILL "
                f"(lease TTL {ttl:g} s)"
            )
            owners = _owners(server, device_names)
            narrate("owners: " + _owner_line(owners))

            # -- 2. a peer is paused at the worst moment ---------------------
            paused = max(
                (n for n in names if n != victim), key=lambda n: (len(owners.get(n, [])), n)
            )
            procs[paused].send_signal(signal.SIGUSR1)

            async def paused_is_stopped() -> bool:
                return _stopped(procs[paused].pid)

            await _support.wait_until(paused_is_stopped, within=within, what=f"{paused} to stop")
            paused_at = trio.current_time()
            held = {d: server.current[d].token for d in _owners(server, device_names)[paused]}
            narrate(
                f"{paused} is stopped (SIGSTOP) with a command in hand; it held {', '.join(held)}"
            )
            await _support.wait_until(
                lambda: taken_over(held), within=within, what="the paused peer's devices to move"
            )
            pause_takeover = trio.current_time() - paused_at
            narrate(f"all devices of {paused} moved {pause_takeover:.2f} s after it stopped")
            procs[paused].send_signal(signal.SIGCONT)
            narrate(f"SIGCONT {paused}: what it had in hand goes out, with its old tokens")

            def stale_rejected() -> bool:
                return any(e.event == "rejected" and e.peer == paused for e in server.entries)

            async def rejected_and_rejoined() -> bool:
                ids = [w.id for w in await client.workers() if w.alive]
                return stale_rejected() and any(i.startswith(paused + ".") for i in ids)

            await _support.wait_until(
                rejected_and_rejoined, within=within, what="the stale command and the rejoin"
            )
            rejoined_as = next(
                w.id for w in await client.workers() if w.id.startswith(paused + ".")
            )
            narrate(f"{paused} found itself fenced and rejoined as {rejoined_as}")

            async def all_held_again() -> bool:
                return await all_acting() and len(await client.processes(QUEUE)) == devices

            await _support.wait_until(all_held_again, within=within, what="every device held")
            narrate("owners: " + _owner_line(_owners(server, device_names)))

            # -- 3. stop ------------------------------------------------------
            await client.delete_queue(QUEUE)
            narrate(f"deleted queue {QUEUE!r}: every session is cancelled where it runs")

            async def all_closed() -> bool:
                return all(server.connected(d) is None for d in device_names)

            await _support.wait_until(all_closed, within=within, what="every session to close")
            for proc in procs.values():
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
            exit_codes: dict[str, int] = {}
            with trio.fail_after(within):
                for name, proc in procs.items():
                    exit_codes[name] = await proc.wait()
            narrate("peers stopped: " + ", ".join(f"{n} exit {c}" for n, c in exit_codes.items()))
        finally:
            with trio.CancelScope(shield=True):
                for proc in procs.values():
                    if proc.returncode is None:
                        proc.send_signal(signal.SIGCONT)
                        proc.kill()
                        await proc.wait()
        nursery.cancel_scope.cancel()

    entries = tuple(server.entries)
    return Report(
        killed=victim,
        paused=paused,
        kill_takeover=kill_takeover,
        pause_takeover=pause_takeover,
        rejected=tuple(e for e in entries if e.event == "rejected"),
        overlaps=count_overlaps(entries),
        rejoined_as=rejoined_as,
        exit_codes=exit_codes,
        entries=entries,
    )


def _stopped(pid: int) -> bool:
    """Whether the child ``pid`` is stopped; its status stays waitable."""
    r = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
    return r is not None and r.si_code == os.CLD_STOPPED


def _owners(server: DeviceServer, devices: list[str]) -> dict[str, list[str]]:
    """Peer (base worker id) -> devices it has an open session with."""
    out: dict[str, list[str]] = {}
    for d in devices:
        s = server.connected(d)
        if s is not None:
            out.setdefault(s.peer, []).append(d)
    return out


def _owner_line(owners: dict[str, list[str]]) -> str:
    return "; ".join(f"{p}: {', '.join(ds)}" for p, ds in sorted(owners.items()))


def summarize(report: Report, say: Callable[[str], None] = print) -> None:
    """Print the device server's log, summarized per device, and the checks."""
    say("")
    say("device server log, per device (session: peer, token, commands accepted):")
    devices = sorted({e.device for e in report.entries}, key=lambda d: (len(d), d))
    for d in devices:
        sessions: dict[int, tuple[str, int, int]] = {}
        for e in report.entries:
            if e.device == d and e.event in ("session", "accepted"):
                peer, token, n = sessions.get(e.session, (e.peer, e.token, 0))
                sessions[e.session] = (peer, token, n + (e.event == "accepted"))
        say(f"  {d}: " + " -> ".join(f"{p} t{t} x{n}" for p, t, n in sessions.values()))
    say(
        f"stale commands rejected: {len(report.rejected)} (sent by {report.paused} as it "
        "resumed, before its fence cancelled its handlers)"
    )
    for e in report.rejected:
        say(f"  {e.device}: {e.detail} (from {e.peer})")
    say(f"sessions of one device acting at once: {report.overlaps}")
    say(
        f"takeover after SIGKILL: {report.kill_takeover:.2f} s; "
        f"after the pause: {report.pause_takeover:.2f} s"
    )
    say("OK" if report.ok else "FAILED")


def main(argv: list[str] | None = None) -> int:
    """Command line: ``device_owners.py [--namespace NS] [--ttl S]``, or the
    ``peer`` mode the run starts its peers in."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode")
    p = sub.add_parser("peer", help="run one peer (started by the demo itself)")
    p.add_argument("--redis", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--device-port", type=int, required=True)
    p.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--namespace", default="example-devices")
    parser.add_argument("--ttl", type=float, default=1.0)
    args = parser.parse_args(argv)

    if args.mode == "peer":
        logging.basicConfig(format=f"    ({args.name} log) %(message)s", level=logging.WARNING)
        trio.run(peer, args.redis, args.namespace, args.name, args.device_port, args.ttl)
        return 0
    if not math.isfinite(args.ttl) or args.ttl <= 0:
        parser.error("--ttl must be a positive number of seconds")
    with _support.redis_url() as url:
        report = trio.run(lambda: run(url, namespace=args.namespace, ttl=args.ttl))
    summarize(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
