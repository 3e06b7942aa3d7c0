"""Serving the dashboard with Hypercorn's trio worker."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from functools import partial

import anyio
from hypercorn.config import Config
from hypercorn.trio import serve

from .._client import Client
from .._errors import ConfigError, raise_single
from ._app import create_app
from ._state import Poller

__all__ = ["serve_dashboard"]

log = logging.getLogger("mesh.dashboard")


@asynccontextmanager
async def serve_dashboard(
    client: Client,
    *,
    port: int = 0,
    host: str = "127.0.0.1",
    token: str | None = None,
    interval: float = 1.0,
    header: dict[str, str] | None = None,
    redact: Callable[[str], str] = lambda s: s,
    allow_hosts: Iterable[str] = (),
) -> AsyncIterator[str]:
    """Serve the dashboard of ``client``'s mesh inside this block.

    Args:
        port: 0 picks a free port.
        host: the address to bind; anything but loopback should come with a
            ``token``.
        interval: seconds between reads of the mesh (one read serves every
            browser).
        header: shown at the top of the page (e.g. the Redis URL without its
            password, and the namespace); never put credentials in it.
        allow_hosts: names a request's ``Host`` header may give besides
            ``host`` (and loopback names when ``host`` is loopback); any
            other is refused with 421 (DNS rebinding).

    Yields:
        The page's URL (``http://host:port/``).
    Raises:
        ConfigError: the address cannot be bound, or a name of
            ``allow_hosts`` is not a host name or address.
        MeshConnectionError: the first read of the mesh failed.

    Leaving the block (also by cancellation) stops the server and the
    poller; open event streams are closed.
    """
    poller = Poller(
        client,
        header=header or {"namespace": client.namespace},
        interval=interval,
        redact=redact,
    )
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = log
    config.graceful_timeout = 0.5
    app = create_app(poller, token=token, host=host, allow_hosts=allow_hosts)
    stopped = anyio.Event()

    async def shutdown_trigger() -> None:
        await stopped.wait()

    try:
        async with anyio.create_task_group() as nursery:
            await nursery.start(poller.run)
            try:
                binds = await nursery.start(
                    partial(serve, app, config, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]
                )
            except (OSError, BaseExceptionGroup) as exc:
                # Hypercorn's binding fails inside its own nursery: an OSError
                # alone or in (nested) groups is a bad address; anything else
                # propagates as it came.
                bind_error = _only_os_error(exc)
                if bind_error is None:
                    raise
                raise ConfigError(
                    f"cannot serve the dashboard on {host}:{port}: "
                    f"{bind_error.strerror or bind_error}"
                ) from None
            try:
                yield binds[0].rstrip("/") + "/"
            finally:
                stopped.set()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as eg:
        raise_single(eg)


def _only_os_error(exc: BaseException) -> OSError | None:
    """The first OSError of ``exc`` if it holds nothing but OSErrors."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        match, rest = exc.split(OSError)
        if match is not None and rest is None:
            leaf: BaseException = match
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            return leaf if isinstance(leaf, OSError) else None
    return None
