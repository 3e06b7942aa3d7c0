"""A peer process driven for the script vectors: each vector's call is sent
as a ``script`` command of the line protocol, so that the peer's own script
loader expands the script and the peer's own client sends it
(protocol/conformance/README.md, "The line protocol").

The harness writes the keyspace before the call and reads it after; the
peer only runs the call, with the vector's time prelude before the
expanded script, and answers with the reply (or the error) and the SHA-1
of its expansion.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from mesh._harness.peer import open_peer

from . import _vectors

REPLY_TIMEOUT = 10.0
"""How long (seconds) the peer has to answer one ``script`` command."""


class PeerRefused(Exception):
    """The peer does not run scripts by name, or broke off (the message says how)."""


class ScriptPeer:
    """One peer process that runs script calls for the vectors."""

    def __init__(self, proc: trio.Process) -> None:
        self._proc = proc
        self._buf = b""

    async def __call__(
        self, script: str, time: Sequence[int], keys: Sequence[Any], args: Sequence[Any]
    ) -> dict[str, Any]:
        """Run one call through the peer: {"reply": ...} or {"error": ...},
        with "sha1" when the peer said it.

        Raises:
            PeerRefused: the peer answered with an error event, wrote a line
                that is not JSON, did not answer within REPLY_TIMEOUT, or exited.
        """
        cmd = {"op": "script", "name": script, "time": list(time), "keys": keys, "args": args}
        assert self._proc.stdin is not None
        try:
            await self._proc.stdin.send_all((json.dumps(cmd) + "\n").encode())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise PeerRefused("the peer does not read its stdin (it exited?)") from None
        with trio.move_on_after(REPLY_TIMEOUT):
            while True:
                ev = await self._event()
                if ev.get("event") == "error":
                    raise PeerRefused(f"the peer refused a script command: {json.dumps(ev)}")
                if ev.get("event") == "ack" and ev.get("op") == "script":
                    out: dict[str, Any] = {}
                    if "error" in ev:
                        out["error"] = _vectors.strip_location(str(ev["error"]))
                    else:
                        out["reply"] = ev.get("reply")
                    if "sha1" in ev:
                        out["sha1"] = ev["sha1"]
                    return out
        raise PeerRefused(f"the peer did not answer a script command within {REPLY_TIMEOUT} s")

    async def _event(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        while b"\n" not in self._buf:
            data = await self._proc.stdout.receive_some(65536)
            if not data:
                raise PeerRefused("the peer exited while running the vectors")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            ev = json.loads(line)
        except ValueError:
            raise PeerRefused(f"the peer wrote {line[:200]!r}, not a JSON line") from None
        if not isinstance(ev, dict):
            raise PeerRefused(f"the peer wrote {line[:200]!r}, not a JSON object")
        return ev


@asynccontextmanager
async def open_script_peer(command: str, url: str, namespace: str) -> AsyncIterator[ScriptPeer]:
    """Start the peer ``command`` (no ``start``: no worker joins) in
    ``namespace``; on exit, send EOF and wait for it at most REPLY_TIMEOUT
    seconds, then kill it. Its stderr is discarded."""
    env = dict(os.environ, MESH_REDIS_URL=url, MESH_NAMESPACE=namespace)
    with tempfile.TemporaryFile() as err:
        proc = await open_peer(
            shlex.split(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
        )
        try:
            yield ScriptPeer(proc)
        finally:
            with trio.CancelScope(shield=True):
                assert proc.stdin is not None
                try:
                    await proc.stdin.aclose()
                except trio.BrokenResourceError:
                    pass
                with trio.move_on_after(REPLY_TIMEOUT):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
