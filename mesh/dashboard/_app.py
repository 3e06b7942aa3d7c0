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

from .._errors import ConfigError, MeshError
from .._keys import check_queue
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

    app: ASGIApp = Starlette(
        routes=[
            Route("/", index),
            Route("/state", state),
            Route("/events", events),
            Route("/api/cancel", cancel, methods=["POST"]),
            Route("/api/dead/{mode:str}", dead, methods=["POST"]),
        ]
    )
    if token:
        app = _TokenGate(app, token)
    return app
