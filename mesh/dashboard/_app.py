"""The dashboard's web app (Starlette, served by Hypercorn's trio worker):
the page, its server-sent event stream, and the actions.

Routes:

* ``GET /``: the page (one HTML file with its script; no build step).
* ``GET /events``: ``text/event-stream``, one ``state`` event (JSON) per read
  of the mesh that a browser has not seen yet.
* ``GET /state``: the latest state, as JSON.
* ``POST /api/cancel``: ``{"queue": Q, "task_b64": ...}`` (or ``"task"``:
  text): cancel a task by payload (see :meth:`mesh.Client.cancel`).
* ``POST /api/dead/requeue``, ``POST /api/dead/purge``: ``{"queue": Q}``: put
  every dead letter of Q back in the queue, or drop them all
  (:meth:`mesh.Client.requeue_dead`, :meth:`mesh.Client.purge_dead`).
* ``POST /api/pause``, ``POST /api/resume``: ``{"queue": Q}``
  (:meth:`mesh.Client.pause`, :meth:`mesh.Client.resume`).
* ``POST /api/job/requeue``, ``POST /api/job/delete``: ``{"queue": Q,
  "task_b64": ...}``: requeue one payload's dead letters; delete a payload:
  its dead letters if it is dead, else every copy of it (a cancel).
* ``GET /api/jobs?queue=Q&state=S&limit=N&after=C&prefix=P``: a page of jobs
  (:meth:`mesh.Client.jobs`; ``prefix`` is text).
* ``GET /api/job?queue=Q&task_b64=...``: one job's record, or ``null``.
* ``GET /api/history?minutes=M[&queue=Q]``: processes finished and failed per
  minute (kept in Redis by the workers, so a restarted dashboard has them).
* ``GET /api/schedules``: the periodic tasks and the next delayed jobs.

Payloads go out as text (``task``, shown cut; never as HTML: the page puts
every value in with ``textContent``) and as base64 (``task_b64``).

Actions need the header ``X-Mesh-Action: 1``, which a cross-site form cannot
send, so another web site cannot make a browser that has the page open
cancel tasks. With a token, every route needs it: as ``Authorization:
Bearer TOKEN``, or once as ``/?token=TOKEN`` (the page then keeps it in a
cookie, HttpOnly and SameSite=Strict, and drops it from the address bar).
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .._browse import Job, MinuteCounts, minute_counts
from .._client import Client
from .._errors import ConfigError, MeshError
from .._keys import check_queue
from .._view import show_payload
from ._state import Poller

__all__ = ["create_app"]

_COOKIE = "mesh_dashboard_token"


def _page() -> str:
    return resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")


class _TokenGate:
    """Refuse every request without the token (pure ASGI, so streaming
    responses pass through untouched)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    def _ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        auth = request.headers.get("authorization", "")
        bearer = auth[7:] if auth.lower().startswith("bearer ") else None
        if self._ok(bearer) or self._ok(request.cookies.get(_COOKIE)):
            await self.app(scope, receive, send)
            return
        if request.url.path == "/" and self._ok(request.query_params.get("token")):
            response: Response = RedirectResponse("/", status_code=303)
            response.set_cookie(_COOKIE, self.token.decode(), httponly=True, samesite="strict")
        else:
            response = Response(
                "a token is needed: Authorization: Bearer TOKEN, or open /?token=TOKEN\n",
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
                media_type="text/plain",
            )
        await response(scope, receive, send)


async def _queue_body(request: Request) -> tuple[str, Response | None]:
    """The queue of an action's body ``{"queue": Q}``, or the error response."""
    if request.headers.get("x-mesh-action") != "1":
        return "", JSONResponse({"error": "missing X-Mesh-Action: 1"}, status_code=403)
    try:
        body: Any = await request.json()
        return check_queue(body["queue"]), None
    except (ValueError, KeyError, TypeError, ConfigError) as exc:
        return "", JSONResponse({"error": f"bad request: {exc}"}, status_code=400)


def job_json(j: Job, *, full: bool = False) -> dict[str, Any]:
    """A job for the page: the payload shown cut (or whole, ``full``: the
    details view) and as base64."""
    d = attrs.asdict(j)
    d["task"] = show_payload(j.task, 4096 if full else 80)
    d["task_b64"] = base64.b64encode(j.task).decode()
    d["size"] = len(j.task)
    if d["token"] is not None:
        d["token"] = str(d["token"])  # beyond a JavaScript number's exact range
    return d


def sum_counts(now: float, counts: list[MinuteCounts], minutes: int) -> dict[str, Any]:
    """Per minute up to the one of ``now``, the finished and failed
    processes summed over ``counts``."""
    last = int(now) // 60
    at = [float(m * 60) for m in range(last - minutes + 1, last + 1)]
    if not counts:
        return {"at": at, "finished": [0] * minutes, "failed": [0] * minutes}
    return {
        "at": at,
        "finished": [sum(c.finished[i] for c in counts) for i in range(len(counts[0].minutes))],
        "failed": [sum(c.failed[i] for c in counts) for i in range(len(counts[0].minutes))],
    }


async def next_delayed(client: Client, n: int) -> list[Job]:
    """The ``n`` first-due delayed jobs over every queue."""
    out: list[Job] = []
    for info in await client.queue_infos():
        if info.delayed:
            out += (await client.jobs(info.name, "delayed", limit=n)).jobs
    out.sort(key=lambda j: j.due or 0.0)
    return out[:n]


def create_app(poller: Poller, *, token: str | None = None) -> ASGIApp:
    """The dashboard's ASGI app, showing what ``poller`` reads (run the
    poller beside it) and acting through ``poller.client``.

    Args:
        token: if given, every request must carry it (see the module doc).
    """
    page = _page()

    async def index(request: Request) -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    async def state(request: Request) -> Response:
        return Response(poller.state, media_type="application/json")

    async def events(request: Request) -> Response:
        async def stream() -> AsyncIterator[str]:
            seen = -1
            while True:
                if poller.version > seen:
                    seen = poller.version
                    yield f"event: state\ndata: {poller.state}\n\n"
                await poller.wait_changed(seen)

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def cancel(request: Request) -> Response:
        if request.headers.get("x-mesh-action") != "1":
            return JSONResponse({"error": "missing X-Mesh-Action: 1"}, status_code=403)
        try:
            body: Any = await request.json()
            queue = check_queue(body["queue"])
            if "task_b64" in body:
                task = base64.b64decode(body["task_b64"], validate=True)
            else:
                task = str(body["task"]).encode()
        except (ValueError, KeyError, TypeError, ConfigError, binascii.Error) as exc:
            return JSONResponse({"error": f"bad request: {exc}"}, status_code=400)
        try:
            n = await poller.client.cancel(queue, task)
        except MeshError as exc:
            return JSONResponse({"error": poller.redact(str(exc))}, status_code=502)
        await poller.poll_once()  # show the result at once
        return JSONResponse({"cancelled": n})

    async def dead(request: Request) -> Response:
        if request.headers.get("x-mesh-action") != "1":
            return JSONResponse({"error": "missing X-Mesh-Action: 1"}, status_code=403)
        mode = request.path_params["mode"]
        if mode not in ("requeue", "purge"):
            return JSONResponse({"error": f"no such action: {mode}"}, status_code=404)
        try:
            body: Any = await request.json()
            queue = check_queue(body["queue"])
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            return JSONResponse({"error": f"bad request: {exc}"}, status_code=400)
        try:
            if mode == "requeue":
                n = await poller.client.requeue_dead(queue)
            else:
                n = await poller.client.purge_dead(queue)
        except MeshError as exc:
            return JSONResponse({"error": poller.redact(str(exc))}, status_code=502)
        await poller.poll_once()
        return JSONResponse({mode + "d": n})

    async def pause(request: Request) -> Response:
        queue, err = await _queue_body(request)
        if err is not None:
            return err
        mode = request.url.path.rsplit("/", 1)[1]
        try:
            if mode == "pause":
                changed = await poller.client.pause(queue)
            else:
                changed = await poller.client.resume(queue)
        except MeshError as exc:
            return JSONResponse({"error": poller.redact(str(exc))}, status_code=502)
        await poller.poll_once()
        return JSONResponse({"queue": queue, "paused": mode == "pause", "changed": changed})

    async def job_action(request: Request) -> Response:
        if request.headers.get("x-mesh-action") != "1":
            return JSONResponse({"error": "missing X-Mesh-Action: 1"}, status_code=403)
        mode = request.path_params["mode"]
        if mode not in ("requeue", "delete"):
            return JSONResponse({"error": f"no such action: {mode}"}, status_code=404)
        try:
            body: Any = await request.json()
            queue = check_queue(body["queue"])
            task = base64.b64decode(body["task_b64"], validate=True)
        except (ValueError, KeyError, TypeError, ConfigError, binascii.Error) as exc:
            return JSONResponse({"error": f"bad request: {exc}"}, status_code=400)
        c = poller.client
        try:
            if mode == "requeue":
                out = {"requeued": await c.requeue_dead(queue, [task])}
            else:
                job = await c.job(queue, task)
                if job is not None and job.state == "dead":
                    out = {"deleted": await c.purge_dead(queue, [task])}
                else:
                    out = {"deleted": await c.cancel(queue, task)}
        except MeshError as exc:
            return JSONResponse({"error": poller.redact(str(exc))}, status_code=502)
        await poller.poll_once()
        return JSONResponse(out)

    async def jobs(request: Request) -> Response:
        qp = request.query_params
        try:
            queue = check_queue(qp.get("queue", ""))
            state = qp.get("state", "queued")
            limit = int(qp.get("limit", "50"))
            prefix = qp.get("prefix") or None
            page = await poller.client.jobs(
                queue, state, limit=limit, after=qp.get("after") or None, prefix=prefix
            )
        except (ValueError, ConfigError) as exc:
            return JSONResponse({"error": f"bad request: {exc}"}, status_code=400)
        except MeshError as exc:
            return JSONResponse({"error": poller.redact(str(exc))}, status_code=502)
        return JSONResponse(
            {
                "queue": queue,
                "state": state,
                "total": page.total,
                "next": page.next,
                "jobs": [job_json(j) for j in page.jobs],
            }
        )

    async def job(request: Request) -> Response:
        qp = request.query_params
        try:
            queue = check_queue(qp.get("queue", ""))
            task = base64.b64decode(qp.get("task_b64", ""), validate=True)
            found = await poller.client.job(queue, task)
        except (ValueError, ConfigError, binascii.Error) as exc:
            return JSONResponse({"error": f"bad request: {exc}"}, status_code=400)
        except MeshError as exc:
            return JSONResponse({"error": poller.redact(str(exc))}, status_code=502)
        return JSONResponse(None if found is None else job_json(found, full=True))

    async def history(request: Request) -> Response:
        qp = request.query_params
        try:
            minutes = int(qp.get("minutes", "60"))
            queue = qp.get("queue")
            c = poller.client
            names = [check_queue(queue)] if queue else await c.queues()
            now, counts = await minute_counts(c._check(), c._keys, names, minutes)
        except (ValueError, ConfigError) as exc:
            return JSONResponse({"error": f"bad request: {exc}"}, status_code=400)
        except MeshError as exc:
            return JSONResponse({"error": poller.redact(str(exc))}, status_code=502)
        return JSONResponse({"minutes": minutes, **sum_counts(now, counts, minutes)})

    async def schedules(request: Request) -> Response:
        try:
            got = await poller.client.schedules()
            delayed = await next_delayed(poller.client, 20)
        except MeshError as exc:
            return JSONResponse({"error": poller.redact(str(exc))}, status_code=502)
        return JSONResponse(
            {
                "schedules": [
                    {
                        "queue": sc.queue,
                        "task": show_payload(sc.task),
                        "every": sc.every,
                        "cron": sc.cron,
                        "next_run": sc.next_run,
                    }
                    for sc in got
                ],
                "delayed": [job_json(j) for j in delayed],
            }
        )

    app: ASGIApp = Starlette(
        routes=[
            Route("/", index),
            Route("/state", state),
            Route("/events", events),
            Route("/api/cancel", cancel, methods=["POST"]),
            Route("/api/dead/{mode:str}", dead, methods=["POST"]),
            Route("/api/pause", pause, methods=["POST"]),
            Route("/api/resume", pause, methods=["POST"]),
            Route("/api/job/{mode:str}", job_action, methods=["POST"]),
            Route("/api/jobs", jobs),
            Route("/api/job", job),
            Route("/api/history", history),
            Route("/api/schedules", schedules),
        ]
    )
    if token:
        app = _TokenGate(app, token)
    return app
