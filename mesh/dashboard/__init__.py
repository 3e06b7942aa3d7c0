"""A live web dashboard for a mesh (the ``dashboard`` extra:
``pip install 'trio-mesh[dashboard]'``): workers, queues, persistent tasks
and their owners, recent takeovers, updated live over server-sent events,
and a confirmed cancel of a task by payload.

``mesh dashboard`` runs it; :func:`serve_dashboard` embeds it in a trio
program. Starlette makes the app and Hypercorn's trio worker serves it (no
HTTP of our own). It binds 127.0.0.1 unless told otherwise; bound elsewhere,
give it a token.
"""

from __future__ import annotations

try:
    import hypercorn  # noqa: F401
    import starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "mesh.dashboard needs starlette and hypercorn: pip install 'trio-mesh[dashboard]'"
    ) from exc

from ._app import create_app as create_app
from ._serve import serve_dashboard as serve_dashboard
from ._state import Poller as Poller

__all__ = ["Poller", "create_app", "serve_dashboard"]
