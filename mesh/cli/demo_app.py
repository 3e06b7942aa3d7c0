"""The app that ``mesh demo`` runs in each peer (``mesh worker
mesh.cli.demo_app:queues``).

``devices`` holds a pretend connection per persistent task until it is
cancelled; ``jobs`` are one-shot tasks that take a few hundred milliseconds.
Each handler prints one JSON line per event on stdout (``connect``,
``disconnect``, ``start``, ``done``), which the demo reads to show what the
handlers saw.
"""

from __future__ import annotations

import json
import sys
import time
import zlib

import anyio

import mesh

__all__ = ["device", "job", "queues"]


def _emit(event: str, p: mesh.Process) -> None:
    record = {
        "event": event,
        "queue": p.queue,
        "task": p.task.decode(errors="replace"),
        "token": p.token,
        "worker": p.worker_id,
        "time": time.time(),
    }
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def device(process: mesh.Process) -> None:
    """Hold the connection to one device until cancelled. A real handler would
    present ``process.token`` to the device, which refuses lower tokens."""
    _emit("connect", process)
    try:
        await anyio.sleep_forever()
    finally:
        _emit("disconnect", process)


async def job(process: mesh.Process) -> None:
    """Work for 300 to 700 ms (fixed per payload), then finish."""
    _emit("start", process)
    await anyio.sleep(0.3 + (zlib.crc32(process.task) % 5) / 10)
    _emit("done", process)


queues = {"devices": device, "jobs": job}
"""The APP mapping: queue name -> handler."""
