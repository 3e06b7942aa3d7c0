"""An asyncio web service that embeds a mesh worker: a Starlette app, served
by uvicorn, holds device connections as persistent tasks and runs report
jobs, and its routes enqueue jobs and read their results.

Run two or more instances against one Redis; together they hold each device
once, and a SIGTERM to one (uvicorn's graceful shutdown) hands its devices to
the others, each once its connection is closed::

    export MESH_REDIS_URL=redis://127.0.0.1:6379 DEVICES=pump-1,pump-2,valve-7
    uvicorn asgi_service:app --app-dir examples --port 8001 &
    uvicorn asgi_service:app --app-dir examples --port 8002 &
    curl -X POST localhost:8001/reports/daily
    curl localhost:8002/reports/daily        # the result, whoever ran it
    curl localhost:8001/devices              # what this instance holds

Environment: ``MESH_REDIS_URL`` (default ``redis://127.0.0.1:6379``),
``MESH_NAMESPACE`` (default ``asgi-demo``), ``DEVICES`` (comma-separated, the
desired set; every instance may say it), ``MESH_TTL`` (seconds, default 3).
It needs ``pip install starlette uvicorn`` beside trio-mesh.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import mesh

URL = os.environ.get("MESH_REDIS_URL", "redis://127.0.0.1:6379")
NAMESPACE = os.environ.get("MESH_NAMESPACE", "asgi-demo")
DEVICES = [d for d in os.environ.get("DEVICES", "pump-1,pump-2,valve-7").split(",") if d]
TTL = float(os.environ.get("MESH_TTL", "3"))

# device -> the fencing token this instance holds it with
held: dict[str, int] = {}


def say(*words: object) -> None:
    """One line on stdout, stamped with the wall clock in ns (the test
    compares the stamps of two instances on one machine)."""
    print(time.time_ns(), *words, flush=True)


async def hold_device(process: mesh.Process) -> None:
    """A persistent task: the one connection to one device. A real service
    opens it with an asyncio client library and hands the device
    ``process.token`` so that it refuses an older owner that comes back."""
    device = process.task.decode()
    held[device] = process.token
    say("connect", device, process.token)
    try:
        await asyncio.Event().wait()  # the connection lives until cancelled or moved
    finally:
        del held[device]
        say("disconnect", device, process.token)


async def write_report(process: mesh.Process) -> bytes:
    """A one-shot job; what it returns is kept as its result."""
    await asyncio.sleep(0.05)  # any asyncio work
    return f"report {process.task.decode()} by {process.worker_id}".encode()


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with mesh.open_worker(URL, namespace=NAMESPACE, ttl=TTL) as worker:
        app.state.client = worker.client
        await worker.client.configure("reports", result_ttl=600)
        await worker.start_work("devices", hold_device, concurrency=1000)
        await worker.start_work("reports", write_report, concurrency=10)
        await worker.client.reconcile("devices", DEVICES)
        say("serving", worker.id)
        yield
    # leaving the worker's block handed every device back, each once its
    # connection had closed
    say("stopped")


async def devices(request: Request) -> JSONResponse:
    return JSONResponse({"held": held})


async def enqueue_report(request: Request) -> JSONResponse:
    name = request.path_params["name"]
    await request.app.state.client.enqueue("reports", name)
    return JSONResponse({"enqueued": name}, status_code=202)


async def report_result(request: Request) -> JSONResponse:
    name = request.path_params["name"]
    try:
        result = await request.app.state.client.result("reports", name, timeout=5)
    except TimeoutError:
        return JSONResponse({"error": f"no result for {name!r} within 5 s"}, status_code=504)
    text = None if result is None else result.decode()
    return JSONResponse({"report": name, "result": text})


app = Starlette(
    routes=[
        Route("/devices", devices),
        Route("/reports/{name}", enqueue_report, methods=["POST"]),
        Route("/reports/{name}", report_result, methods=["GET"]),
    ],
    lifespan=lifespan,
)
