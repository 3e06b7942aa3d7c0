"""The console's routes for a queue's groups: ``GET /api/groups`` (the top
groups by jobs queued, with totals) and ``POST /api/group/pause``,
``POST /api/group/resume`` (one group, through the app's action rules:
the ``X-Mesh-Action`` header, and the token when there is one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._errors import MeshError
from .._group_reads import GroupInfo, GroupsLook
from .._keys import check_queue
from ._requests import BadRequest, group_field, int_param, json_body, queue_field
from ._state import Poller

__all__ = ["MAX_GROUPS", "group_routes", "look_json"]

#: The most groups one ``/api/groups`` answer lists.
MAX_GROUPS = 1000


def _group_json(g: GroupInfo) -> dict[str, Any]:
    s = g.settings
    return {
        "name": g.name,
        "queued": g.queued,
        "running": g.running,
        "delayed": g.delayed,
        "concurrency": s.concurrency,
        "rate_limit": s.rate_limit,
        "rate_period": s.rate_period,
        "weight": s.weight,
        "own": attrs.asdict(g.own),
        "paused": g.paused,
        "ready": g.ready,
        "waiting_until": g.waiting_until,
    }


def look_json(queue: str, look: GroupsLook) -> dict[str, Any]:
    """``/api/groups``'s answer: the listed groups, the totals and the
    queue's default settings for every group."""
    return {
        "queue": queue,
        "total": look.total,
        "queued": look.queued,
        "running": look.running,
        "delayed": look.delayed,
        "default": attrs.asdict(look.default),
        "groups": [_group_json(g) for g in look.groups],
    }


def group_routes(
    poller: Poller,
    failed: Callable[[BadRequest | MeshError], Response],
    refused: Callable[[Request], Response | None],
) -> list[Route]:
    """The routes, answering errors with ``failed`` and refusing an action
    without its header with ``refused`` (the app's own rules)."""

    async def groups(request: Request) -> Response:
        qp = request.query_params
        try:
            queue = check_queue(qp.get("queue", ""))
            limit = int_param(qp, "limit", 20)
            if not 1 <= limit <= MAX_GROUPS:
                raise BadRequest(f"limit must be 1 to {MAX_GROUPS}, got {limit}")
            look = await poller.client.groups(queue, limit=limit)
        except (BadRequest, MeshError) as exc:
            return failed(exc)
        return JSONResponse(look_json(queue, look))

    async def pause(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        mode = request.url.path.rsplit("/", 1)[1]
        try:
            body = await json_body(request, '{"queue": "Q", "group": "G"}')
            queue, group = queue_field(body), group_field(body)
            c = poller.client
            fn = c.pause_group if mode == "pause" else c.resume_group
            changed = await fn(queue, group)
        except (BadRequest, MeshError) as exc:
            return failed(exc)
        await poller.poll_once()
        return JSONResponse(
            {"queue": queue, "group": group, "paused": mode == "pause", "changed": changed}
        )

    return [
        Route("/api/groups", groups),
        Route("/api/group/pause", pause, methods=["POST"]),
        Route("/api/group/resume", pause, methods=["POST"]),
    ]
