"""The peer processes of a scenario's run: launched with the namespace and
Redis URL in their environment, their lines read and recorded, commands
sent and answered, stopped at the end, and their Redis connections found
and closed on demand."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import trio

from mesh._harness.peer import open_peer

from ._record import REPLY_TIMEOUT, PeerProc, Record, ScenarioFailed


class Peers(Record):
    """A run's peer processes (see the module docstring)."""

    async def launch(self, nursery: anyio.abc.TaskGroup, peer: PeerProc) -> None:
        env = dict(os.environ, MESH_REDIS_URL=self.url, MESH_NAMESPACE=self.namespace)
        peer.stderr = tempfile.TemporaryFile()
        peer.proc = await open_peer(
            shlex.split(peer.command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=peer.stderr,
            env=env,
        )
        peer.pid = peer.proc.pid
        nursery.start_soon(self._read, peer)

    async def _read(self, peer: PeerProc) -> None:
        assert peer.proc is not None and peer.proc.stdout is not None
        buf = b""
        async with peer.proc.stdout:
            while True:
                try:
                    data = await peer.proc.stdout.receive_some(65536)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    data = b""
                t = self.now()
                if not data:
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    try:
                        ev = json.loads(line)
                        if not isinstance(ev, dict):
                            raise ValueError("not an object")
                    except ValueError:
                        self.fail("line protocol", f"peer {peer.name} wrote {line[:200]!r}")
                        continue
                    self._record(peer, t, ev)
        peer.exit_code = await peer.proc.wait()
        t = self.now()
        self._close_peer(peer, peer.killed_at if peer.killed_at is not None else t, "exited")
        peer.exited.set()
        old = self.any_event
        self.any_event = anyio.Event()
        old.set()

    async def send(self, peer: PeerProc, cmd: dict[str, Any]) -> None:
        assert peer.proc is not None and peer.proc.stdin is not None
        try:
            await peer.proc.stdin.send_all((json.dumps(cmd) + "\n").encode())
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ScenarioFailed(f"peer {peer.name} does not read its stdin ({exc})") from None

    async def request(self, peer: PeerProc, cmd: dict[str, Any]) -> dict[str, Any]:
        """Send ``cmd`` and return its reply (an ack of its op, or an error)."""
        seen = len(peer.events)
        await self.send(peer, cmd)

        def reply() -> dict[str, Any] | None:
            for _, ev in peer.events[seen:]:
                if ev.get("event") == "error" or (
                    ev.get("event") == "ack" and ev.get("op") == cmd["op"]
                ):
                    return ev
            return None

        ev: dict[str, Any] = await self.wait_for(
            f"peer {peer.name} did not answer {json.dumps(cmd)} within {REPLY_TIMEOUT} s",
            reply,
            REPLY_TIMEOUT,
        )
        if ev.get("event") == "error":
            raise ScenarioFailed(f"peer {peer.name} refused {json.dumps(cmd)}: {json.dumps(ev)}")
        return ev

    def stderr_tail(self, peer: PeerProc, lines: int = 8) -> str:
        if peer.stderr is None:
            return ""
        peer.stderr.seek(0)
        text = peer.stderr.read().decode(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:])

    async def finish(self, nursery: anyio.abc.TaskGroup) -> None:
        """Stop every peer still running (stop, then SIGKILL), read their last lines."""
        with anyio.CancelScope(shield=True):
            for peer in self.peers.values():
                if peer.proc is None or peer.exited.is_set():
                    continue
                if peer.paused:
                    peer.proc.send_signal(signal.SIGCONT)
                with anyio.move_on_after(REPLY_TIMEOUT):
                    try:
                        assert peer.proc.stdin is not None
                        await peer.proc.stdin.aclose()
                    except trio.BrokenResourceError:
                        pass
                    await peer.exited.wait()
                if not peer.exited.is_set():
                    self.fail(
                        "graceful stop",
                        f"peer {peer.name} did not exit within {REPLY_TIMEOUT} s of EOF on stdin",
                    )
                    peer.killed_at = self.now()
                    peer.proc.kill()
                    await peer.exited.wait()
            nursery.cancel_scope.cancel()

    async def kill_connections(self, pid: int) -> int:
        """Close the Redis connections of process ``pid`` (``CLIENT KILL ID``),
        found by matching ``CLIENT LIST``'s addresses with the process's
        sockets (/proc, Linux)."""
        ports = _local_ports(pid)
        listing = await self.conn.execute("CLIENT", "LIST")
        n = 0
        for line in listing.decode().splitlines():
            fields = dict(f.split("=", 1) for f in line.split(" ") if "=" in f)
            port = int(fields.get("addr", ":0").rsplit(":", 1)[1])
            if port in ports:
                n += await self.conn.execute("CLIENT", "KILL", "ID", fields["id"])
        return n


def _local_ports(pid: int) -> set[int]:
    """Local TCP ports of the sockets process ``pid`` has open (Linux /proc)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports
