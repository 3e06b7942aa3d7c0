"""The peers of ``mesh demo``: ``mesh worker`` OS processes started through the
harness (:mod:`mesh._harness.peer`), what their handlers print (one JSON line
per event, see :mod:`mesh.cli.demo_app`) and the tail of their logs."""

from __future__ import annotations

import collections
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

import anyio
import anyio.abc
import attrs
import trio

from mesh._harness.peer import open_peer, python

__all__ = ["Event", "Peer", "launch", "stop_all"]


@attrs.define
class Event:
    """One line a peer's handler printed (see :mod:`mesh.cli.demo_app`)."""

    kind: str
    queue: str
    task: str
    token: int
    worker: str
    at: float  # anyio.current_time() when the demo read it


@attrs.define(eq=False)
class Peer:
    name: str
    proc: trio.Process
    launched: float
    verbose: bool = False
    events: list[Event] = attrs.Factory(list)
    log: collections.deque[str] = attrs.Factory(lambda: collections.deque(maxlen=20))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    def last_log(self) -> str:
        """The last telling line the peer wrote on stderr: an error message
        rather than a traceback's frame or an exception group's frame line."""
        for line in reversed(self.log):
            text = line.strip().lstrip("|").strip()
            if text and text[0] not in "+-^~" and not text.startswith(("File ", "Traceback")):
                return text
        return "(no output; try --verbose)"

    def on_event(self, line: bytes) -> None:
        try:
            d = json.loads(line)
            ev = Event(
                d["event"], d["queue"], d["task"], int(d["token"]), d["worker"],
                anyio.current_time(),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError):
            self.log.append(line.decode(errors="replace"))
            return
        self.events.append(ev)

    def on_log(self, line: bytes) -> None:
        text = line.decode(errors="replace")
        self.log.append(text)
        if self.verbose:
            print(f"  [{self.name}] {text}", file=sys.stderr, flush=True)


async def launch(
    name: str,
    args: Sequence[str],
    env: Mapping[str, str],
    readers: anyio.abc.TaskGroup,
    verbose: bool,
) -> Peer:
    """Start ``mesh worker ARGS`` as the peer ``name``, reading its events and
    its log in ``readers``."""
    # A session of its own: a Ctrl-C in the terminal reaches the demo,
    # which stops the peers in order, rather than every peer at once.
    proc = await open_peer(
        python("-m", "mesh.cli", "worker", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    peer = Peer(name, proc, anyio.current_time(), verbose)
    assert proc.stdout is not None and proc.stderr is not None
    readers.start_soon(_read_lines, proc.stdout, peer.on_event)
    readers.start_soon(_read_lines, proc.stderr, peer.on_log)
    return peer


async def stop_all(peers: Sequence[Peer], grace: float) -> None:
    """SIGTERM every peer still running, wait at most ``grace`` seconds,
    SIGKILL the rest; reap them all."""
    live = [p for p in peers if p.running]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.proc.send_signal(signal.SIGTERM)
    with anyio.move_on_after(grace):
        for p in live:
            await p.proc.wait()
    for p in peers:
        if p.running:
            with contextlib.suppress(ProcessLookupError):
                p.proc.kill()
            await p.proc.wait()
        for stream in (p.proc.stdout, p.proc.stderr):
            if stream is not None:
                await stream.aclose()


async def _read_lines(stream: trio.abc.ReceiveStream, on_line: Callable[[bytes], None]) -> None:
    """Call ``on_line`` with each line of ``stream`` until it ends."""
    buf = b""
    try:
        async for chunk in stream:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                on_line(line)
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        pass
    if buf:
        on_line(buf)
