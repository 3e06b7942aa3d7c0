"""examples/asgi_service.py as a user runs it: two uvicorn instances of the
Starlette app against one Redis, real HTTP requests, and a SIGTERM that hands
the first instance's devices to the second with no overlap."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from mesh.testing import free_port, wait_until

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEVICES = ["pump-1", "pump-2", "valve-7", "valve-8"]


class Instance:
    """One uvicorn process serving the example app; its stdout goes to a file."""

    def __init__(self, url: str, namespace: str, out: Path) -> None:
        self.port = free_port()
        self.out = out
        env = dict(os.environ)
        env.update(
            MESH_REDIS_URL=url, MESH_NAMESPACE=namespace, DEVICES=",".join(DEVICES), MESH_TTL="3"
        )
        argv = [sys.executable, "-m", "uvicorn", "asgi_service:app", "--app-dir", str(EXAMPLES)]
        argv += ["--port", str(self.port), "--host", "127.0.0.1", "--log-level", "warning"]
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out.open("wb"),
            stderr=subprocess.PIPE,
        )

    async def request(self, method: str, path: str) -> tuple[int, Any]:
        def go() -> tuple[int, Any]:
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        return await anyio.to_thread.run_sync(go)

    async def held(self) -> dict[str, int]:
        status, body = await self.request("GET", "/devices")
        assert status == 200, body
        return dict(body["held"])

    async def up(self) -> bool:
        try:
            await self.held()
        except OSError:
            return False
        return True

    def intervals(self) -> dict[str, list[tuple[int, float]]]:
        """device -> [(connect stamp, disconnect stamp or inf)] from its output."""
        out: dict[str, list[tuple[int, float]]] = {}
        for line in self.out.read_text().splitlines():
            stamp, what, *rest = line.split()
            if what == "connect":
                out.setdefault(rest[0], []).append((int(stamp), math.inf))
            elif what == "disconnect":
                start, _ = out[rest[0]][-1]
                out[rest[0]][-1] = (start, int(stamp))
        return out


async def test_two_instances_share_the_devices_serve_jobs_and_hand_over_on_sigterm(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    a = Instance(redis_url, namespace, tmp_path / "a.out")
    b: Instance | None = None
    try:
        await wait_until(a.up, 30, "instance A serves HTTP")
        await wait_until(lambda: _same(a.held(), DEVICES), 10, "A holds every device")
        b = Instance(redis_url, namespace, tmp_path / "b.out")
        await wait_until(b.up, 30, "instance B serves HTTP")
        inst_b = b

        async def shared() -> bool:
            ha, hb = await a.held(), await inst_b.held()
            return sorted([*ha, *hb]) == sorted(DEVICES) and len(hb) == len(DEVICES) // 2

        await wait_until(shared, 20, "A and B hold half the devices each, each once")

        # a job enqueued through A's route; its result read through B's
        status, body = await a.request("POST", "/reports/daily")
        assert (status, body) == (202, {"enqueued": "daily"})
        status, body = await b.request("GET", "/reports/daily")
        assert status == 200 and body["result"].startswith("report daily by "), body

        before = {**await a.held(), **await b.held()}
        a.proc.send_signal(signal.SIGTERM)
        await anyio.to_thread.run_sync(a.proc.wait, 15)
        # uvicorn 0.29 and later re-raise the signal once the graceful
        # shutdown (the lifespan's end: the worker's hand-back) is done
        assert a.proc.returncode in (0, -signal.SIGTERM), a.proc.returncode
        # B holds every device at once (a hand-back, not a TTL), with new tokens
        await wait_until(lambda: _same(inst_b.held(), DEVICES), 2, "B holds every device")
        after = await b.held()
        for device in DEVICES:
            assert after[device] >= before[device]
        assert "stopped" in a.out.read_text()
    finally:
        for inst in (a, b):
            if inst is not None and inst.proc.poll() is None:
                inst.proc.kill()
                inst.proc.wait()
    # no device was ever connected by both at once (wall-clock stamps of one
    # machine): each connection closed before the next one opened
    spans_a, spans_b = a.intervals(), b.intervals()
    for device in DEVICES:
        spans = sorted([*spans_a.get(device, []), *spans_b.get(device, [])])
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, (device, spans)


async def _same(held: Any, devices: list[str]) -> bool:
    return sorted(await held) == sorted(devices)
