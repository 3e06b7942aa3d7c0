"""The dashboard's web app (Starlette, served by Hypercorn's trio worker):
the page, its server-sent event stream, and the actions.

Routes:

* ``GET /``: the page (one HTML file with its script; no build step).
* ``GET /events``: ``text/event-stream``, one ``state`` event (JSON) per read
  of the mesh that a browser has not seen yet.
* ``GET /state``: the latest state, as JSON.
* ``POST /api/cancel``: ``{"queue": Q, "ref": R}`` (a listed job's ref), or
  ``"key"`` (a persistent task's row), ``"task_b64"`` or ``"task"`` (text):
  cancel a task by payload (see :meth:`mesh.Client.cancel`); with
  ``"group": G``, its copies queued in group G of Q are removed too.
* ``POST /api/dead/requeue``, ``POST /api/dead/purge``: ``{"queue": Q}``: put
  every dead letter of Q back in the queue, or drop them all
  (:meth:`mesh.Client.requeue_dead`, :meth:`mesh.Client.purge_dead`).
* ``POST /api/pause``, ``POST /api/resume``: ``{"queue": Q}``
  (:meth:`mesh.Client.pause`, :meth:`mesh.Client.resume`).
* ``POST /api/job/requeue``, ``POST /api/job/delete``, ``POST /api/job/run``:
  ``{"queue": Q, "ref": R}`` (or ``"task_b64"``): requeue one payload's dead
  letters; delete a payload: its dead letters if it is dead, else every copy
  of it (a cancel); make a delayed one-shot job due now.
* ``GET /api/jobs?queue=Q&state=S&limit=N&after=C&prefix=P&group=G``: a page
  of jobs (:meth:`mesh.Client.jobs`; ``prefix`` is text; with ``group``, the
  jobs of group G of Q in state S, without a prefix).
* ``GET /api/job?queue=Q&ref=R``: one job's record (the first 4096
  characters of its payload), or ``null``.
* ``GET /api/payload?queue=Q&ref=R``: one job's whole payload, as a download.
* ``GET /api/completed?queue=Q&limit=N&after=C``: finished jobs whose
  results Q keeps (a queue with a result TTL), newest first in a page, with
  the first bytes of their payloads and results.
* ``GET /api/worker?id=W``: what worker W holds (its running processes on
  each queue it serves), or ``null`` if there is no such worker.
* ``GET /api/history?minutes=M[&queue=Q]``: processes finished and failed per
  minute (kept in Redis by the workers, so a restarted dashboard has them).
* ``GET /api/schedules``: the periodic tasks and the next delayed jobs.
* ``GET /api/groups?queue=Q&limit=N``: Q's groups, the most jobs queued
  first, with the totals and the default settings (:mod:`._groups`).
* ``POST /api/group/pause``, ``POST /api/group/resume``: ``{"queue": Q,
  "group": G}`` (:meth:`mesh.Client.pause_group`, ``resume_group``).

No answer carries a whole payload but ``/api/payload``: a payload may be
64 MiB. Lists, the state and the events carry the first bytes of each as text
(``task``, shown cut; never as HTML: the page puts every value in with
``textContent``), its ``size``, and a short key: a job's ``ref`` (its state,
position or token, and a fingerprint of its payload), a persistent task's
``key``. Bad requests are answered 400 with one line naming what was wrong.

Every request must name the dashboard's own address in its ``Host`` header
(or a loopback name, or a name given with ``allow_hosts``): anything else is
refused with 421, so a page whose DNS name is rebound to 127.0.0.1 cannot
read the state or act (DNS rebinding).

Actions need the header ``X-Mesh-Action: 1``, which a cross-site form cannot
send, so another web site cannot make a browser that has the page open
cancel tasks. With a token, every route needs it: as ``Authorization:
Bearer TOKEN``, or once as ``/?token=TOKEN`` (the page then keeps it in a
cookie, HttpOnly and SameSite=Strict, and drops it from the address bar).
"""

from __future__ import annotations

import base64
import hmac
from collections.abc import AsyncIterator, Callable, Iterable
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

from .._blob import fetch
from .._browse import MAX_LIMIT, Job, MinuteCounts, cursor_position, minute_counts
from .._browse import completed as browse_completed
from .._browse import payload as browse_payload
from .._client import Client
from .._errors import ConfigError, MeshError
from .._keys import check_group, check_queue
from .._view import show_payload
from ._groups import group_routes
from ._hosts import HostGate, allowed_hosts
from ._requests import (
    BadRequest,
    b64_field,
    group_field,
    int_param,
    json_body,
    queue_field,
    text_field,
)
from ._state import Poller
from ._text import shown

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


def _refused(request: Request) -> Response | None:
    """403 for an action without ``X-Mesh-Action: 1``, else None."""
    if request.headers.get("x-mesh-action") != "1":
        return JSONResponse({"error": "missing X-Mesh-Action: 1"}, status_code=403)
    return None


def _bad(exc: Exception) -> Response:
    return JSONResponse({"error": f"bad request: {exc}"}, status_code=400)


def job_json(j: Job, *, full: bool = False) -> dict[str, Any]:
    """A job for the page: the first bytes of its payload shown as text (80
    characters, or 4096 with ``full``: the details view), its size and its
    ref (the short key of :func:`mesh._browse.payload`); never the whole
    payload, which may be 64 MiB."""
    d = attrs.asdict(j)
    width = 4096 if full else 80
    d["task"] = shown(j.task, j.size, width)
    # whether the page shows the whole payload (else it offers a download)
    d["whole"] = j.whole and d["task"] == show_payload(j.task, width + 1)
    if d["token"] is not None:
        d["token"] = str(d["token"])  # beyond a JavaScript number's exact range
    if not full:
        d["traceback"] = None  # a list shows the error's line; the details view all
    # a group's queued job has no ref (its list is not one of the states'):
    # a whole small payload names it for a cancel instead
    d["task_b64"] = (
        base64.b64encode(j.task).decode() if j.ref is None and j.group and j.whole else None
    )
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


def create_app(
    poller: Poller,
    *,
    token: str | None = None,
    host: str = "127.0.0.1",
    allow_hosts: Iterable[str] = (),
) -> ASGIApp:
    """The dashboard's ASGI app, showing what ``poller`` reads (run the
    poller beside it) and acting through ``poller.client``.

    Args:
        token: if given, every request must carry it (see the module doc).
        host: the address it is bound to: a request must name it (or a
            loopback name, when it is a loopback address) in its ``Host``
            header, else it is refused with 421 (DNS rebinding).
        allow_hosts: more names the ``Host`` header may give (a proxy's,
            a DNS name of the machine).

    Raises:
        ConfigError: a name of ``allow_hosts`` is not a host name or address.
    """
    names, any_ip = allowed_hosts(host, allow_hosts)
    routes = [
        *_page_routes(poller),
        *_task_routes(poller),
        *_queue_routes(poller),
        *_job_routes(poller),
        *_ran_routes(poller),
        *_mesh_routes(poller),
        *group_routes(poller, _failed(poller), _refused),
    ]
    app: ASGIApp = Starlette(routes=routes)
    if token:
        app = _TokenGate(app, token)
    return HostGate(app, names, any_ip=any_ip)


def _failed(poller: Poller) -> Callable[[BadRequest | MeshError], Response]:
    """How the API answers an error: 400 naming what was wrong in the
    request (a ``ConfigError`` included: a bad name or value), 502 for the
    mesh's other errors (Redis unreachable, ...), with no password in it."""

    def failed(exc: BadRequest | MeshError) -> Response:
        if isinstance(exc, BadRequest | ConfigError):
            return _bad(exc)
        return JSONResponse({"error": poller.redact(str(exc))}, status_code=502)

    return failed


def _page_routes(poller: Poller) -> list[Route]:
    """The page and the state it shows: ``/``, ``/state``, ``/events``."""
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

    return [Route("/", index), Route("/state", state), Route("/events", events)]


def _task_routes(poller: Poller) -> list[Route]:
    """Actions on one task: ``/api/cancel``, ``/api/job/{mode}``."""
    failed = _failed(poller)

    async def find(queue: str, body: dict[str, Any]) -> bytes | None:
        """The payload an action's body names: ``ref`` (a listed job),
        ``key`` (a row of the persistent tasks), ``task_b64`` or ``task``
        (text); None when a ref or key no longer names one."""
        if "ref" in body:
            ref = text_field(body, "ref")
            c = poller.client
            # as the queue holds it: a big payload's stand-in names it in
            # every call an action makes, and its blob is not read
            return await browse_payload(c.reads, queue, ref, whole=False)
        if "key" in body:
            return poller.persistent_payload(queue, text_field(body, "key"))
        if "task_b64" in body:
            return b64_field(body, "task_b64")
        if "task" in body:
            return text_field(body, "task").encode()
        raise BadRequest("name the task: 'ref', 'key', 'task_b64' or 'task'")

    async def cancel(request: Request) -> Response:
        if (refused := _refused(request)) is not None:
            return refused
        try:
            body = await json_body(request, '{"queue": "Q", "ref": "R"}')
            queue = queue_field(body)
            group = group_field(body) if "group" in body else None
            task = await find(queue, body)
            n = 0 if task is None else await poller.client.cancel(queue, task, group=group)
        except (BadRequest, MeshError) as exc:
            return failed(exc)
        await poller.poll_once()  # show the result at once
        return JSONResponse({"cancelled": n})

    async def job_action(request: Request) -> Response:
        if (refused := _refused(request)) is not None:
            return refused
        mode = request.path_params["mode"]
        if mode not in ("requeue", "delete", "run"):
            return JSONResponse({"error": f"no such action: {mode}"}, status_code=404)
        c = poller.client
        try:
            body = await json_body(request, '{"queue": "Q", "ref": "R"}')
            queue = queue_field(body)
            task = await find(queue, body)
            if task is None:
                out = {"requeue": {"requeued": 0}, "delete": {"deleted": 0}}.get(
                    mode, {"due": False}
                )
            elif mode == "run":
                # due now (delay.lua keeps the earlier time); only if it is
                # still delayed, else a second copy would be added
                job = await c.job(queue, task)
                due = job is not None and job.state == "delayed"
                if due:
                    # an enqueue takes the whole payload, not a stand-in
                    whole = await fetch(c.reads.check(), c.reads.keys, task)
                    await c.enqueue(queue, whole, delay=0)
                out = {"due": due}
            elif mode == "requeue":
                out = {"requeued": await c.requeue_dead(queue, [task])}
            else:
                job = await c.job(queue, task)
                if job is not None and job.state == "dead":
                    out = {"deleted": await c.purge_dead(queue, [task])}
                else:
                    out = {"deleted": await c.cancel(queue, task)}
        except (BadRequest, MeshError) as exc:
            return failed(exc)
        await poller.poll_once()
        return JSONResponse(out)

    return [
        Route("/api/cancel", cancel, methods=["POST"]),
        Route("/api/job/{mode:str}", job_action, methods=["POST"]),
    ]


def _queue_routes(poller: Poller) -> list[Route]:
    """Actions on a queue: ``/api/dead/{mode}``, ``/api/pause``, ``/api/resume``."""
    failed = _failed(poller)

    async def dead(request: Request) -> Response:
        if (refused := _refused(request)) is not None:
            return refused
        mode = request.path_params["mode"]
        if mode not in ("requeue", "purge"):
            return JSONResponse({"error": f"no such action: {mode}"}, status_code=404)
        try:
            queue = queue_field(await json_body(request, '{"queue": "Q"}'))
            if mode == "requeue":
                n = await poller.client.requeue_dead(queue)
            else:
                n = await poller.client.purge_dead(queue)
        except (BadRequest, MeshError) as exc:
            return failed(exc)
        await poller.poll_once()
        return JSONResponse({mode + "d": n})

    async def pause(request: Request) -> Response:
        if (refused := _refused(request)) is not None:
            return refused
        mode = request.url.path.rsplit("/", 1)[1]
        try:
            queue = queue_field(await json_body(request, '{"queue": "Q"}'))
            if mode == "pause":
                changed = await poller.client.pause(queue)
            else:
                changed = await poller.client.resume(queue)
        except (BadRequest, MeshError) as exc:
            return failed(exc)
        await poller.poll_once()
        return JSONResponse({"queue": queue, "paused": mode == "pause", "changed": changed})

    return [
        Route("/api/dead/{mode:str}", dead, methods=["POST"]),
        Route("/api/pause", pause, methods=["POST"]),
        Route("/api/resume", pause, methods=["POST"]),
    ]


def _job_routes(poller: Poller) -> list[Route]:
    """A queue's jobs: ``/api/jobs``, ``/api/job``, ``/api/payload``."""
    failed = _failed(poller)

    async def jobs(request: Request) -> Response:
        qp = request.query_params
        try:
            queue = check_queue(qp.get("queue", ""))
            state = qp.get("state", "queued")
            limit = int_param(qp, "limit", 50)
            prefix = qp.get("prefix") or None
            group = check_group(qp["group"]) if "group" in qp else None
            page = await poller.client.jobs(
                queue, state, limit=limit, after=qp.get("after") or None, prefix=prefix, group=group
            )
            policy = await poller.client.policy(queue)
        except (BadRequest, MeshError) as exc:
            return failed(exc)
        return JSONResponse(
            {
                "queue": queue,
                "state": state,
                "group": group,
                "total": page.total,
                "next": page.next,
                "limit": limit,
                "position": cursor_position(qp.get("after") or None),
                "enqueue_times": policy is not None and policy.enqueue_times,
                "jobs": [job_json(j) for j in page.jobs],
            }
        )

    async def job(request: Request) -> Response:
        """One job's record by its ref (or its payload as ``task_b64``), the
        first 4096 characters of its payload shown, never the whole."""
        qp = request.query_params
        try:
            queue = check_queue(qp.get("queue", ""))
            ref = qp.get("ref")
            c = poller.client
            if ref is not None:  # a big payload's stand-in: its blob is not read
                task = await browse_payload(c.reads, queue, ref, whole=False)
            else:
                task = b64_field(qp, "task_b64")
            found = None if task is None else await c.job(queue, task)
            del task
            policy = None if found is None else await c.policy(queue)
        except (BadRequest, MeshError) as exc:
            return failed(exc)
        if found is None:
            return JSONResponse(None)
        if found.ref is None and ref is not None:
            found = attrs.evolve(found, ref=ref)
        timed = policy is not None and policy.enqueue_times
        return JSONResponse({**job_json(found, full=True), "enqueue_times": timed})

    async def payload(request: Request) -> Response:
        """The whole payload of a job, by its ref, as a download."""
        qp = request.query_params
        try:
            queue = check_queue(qp.get("queue", ""))
            c = poller.client
            task = await browse_payload(c.reads, queue, qp.get("ref", ""))
        except (BadRequest, MeshError) as exc:
            return failed(exc)
        if task is None:
            return JSONResponse({"error": "this job is not on the queue any more"}, status_code=404)
        return Response(
            task,
            media_type="application/octet-stream",
            headers={"Content-Disposition": 'attachment; filename="payload.bin"'},
        )

    return [Route("/api/jobs", jobs), Route("/api/job", job), Route("/api/payload", payload)]


def _ran_routes(poller: Poller) -> list[Route]:
    """What ran: ``/api/completed``, ``/api/history``."""
    failed = _failed(poller)

    async def done(request: Request) -> Response:
        """A page of the finished jobs whose results the queue keeps."""
        qp = request.query_params
        c = poller.client
        try:
            queue = check_queue(qp.get("queue", ""))
            limit = int_param(qp, "limit", 50)
            got, nxt = await browse_completed(
                c.reads, queue, limit=limit, after=qp.get("after") or None
            )
        except (BadRequest, MeshError) as exc:
            return failed(exc)
        return JSONResponse(
            {
                "queue": queue,
                "next": nxt,
                "jobs": [
                    {
                        "queue": x.queue,
                        "state": "completed",
                        "task": shown(x.task, x.size),
                        "size": x.size,
                        "finished": x.finished,
                        "worker": x.worker,
                        "result": None if x.result is None else shown(x.result, x.result_size, 200),
                        "result_size": x.result_size,
                    }
                    for x in got
                ],
            }
        )

    async def history(request: Request) -> Response:
        qp = request.query_params
        try:
            minutes = int_param(qp, "minutes", 60)
            queue = qp.get("queue")
            c = poller.client
            names = [check_queue(queue)] if queue else await c.queues()
            now, counts = await minute_counts(c.reads, names, minutes)
        except (BadRequest, MeshError) as exc:
            return failed(exc)
        return JSONResponse({"minutes": minutes, **sum_counts(now, counts, minutes)})

    return [Route("/api/completed", done), Route("/api/history", history)]


def _mesh_routes(poller: Poller) -> list[Route]:
    """Who runs what, and what runs next: ``/api/worker``, ``/api/schedules``."""
    failed = _failed(poller)

    async def worker(request: Request) -> Response:
        """What one worker holds: its running processes on every queue it
        serves (the first 1000 of each queue, by token), payloads shown cut."""
        qp = request.query_params
        wid = qp.get("id", "")
        if not wid:
            return _bad(BadRequest("missing 'id' (a worker id)"))
        c = poller.client
        try:
            found = [w for w in await c.workers() if w.id == wid]
            held: list[Job] = []
            if found:
                for q in found[0].queues:
                    page = await c.jobs(q, "running", limit=MAX_LIMIT)
                    held += [j for j in page.jobs if j.worker == wid]
        except (BadRequest, MeshError) as exc:
            return failed(exc)
        if not found:
            return JSONResponse(None)
        return JSONResponse({"id": wid, "jobs": [job_json(j) for j in held]})

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
                        "task": shown(sc.task, len(sc.task)),
                        "every": sc.every,
                        "cron": sc.cron,
                        "next_run": sc.next_run,
                    }
                    for sc in got
                ],
                "delayed": [job_json(j) for j in delayed],
            }
        )

    return [Route("/api/worker", worker), Route("/api/schedules", schedules)]
