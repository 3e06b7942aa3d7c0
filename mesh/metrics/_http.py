"""Serving a registry over HTTP: prometheus-client's own server (the text
exposition format and content negotiation done by the library, not by us),
in its thread, stopped when the block is left."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.to_thread
from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry

from .._errors import ConfigError

__all__ = ["serve_metrics"]


@asynccontextmanager
async def serve_metrics(
    registry: CollectorRegistry, *, port: int, host: str = "127.0.0.1"
) -> AsyncIterator[tuple[str, int]]:
    """Serve ``registry`` at ``http://host:port/metrics`` inside this block.

    Yields:
        The address it listens on (with the real port when ``port`` is 0).
    Raises:
        ConfigError: the address cannot be bound (in use, not local, ...).

    Leaving the block (also by cancellation) stops the server; a scrape in
    progress then gets what it had, or no answer.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"port must be 0 to 65535, not {port}")
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    try:
        yield str(server.server_address[0]), int(server.server_address[1])
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(server.shutdown)
        server.server_close()
        thread.join(timeout=1)
