"""OpenTelemetry spans for handler runs (the ``telemetry`` extra:
``pip install 'trio-mesh[telemetry]'``).

When ``opentelemetry-api`` is importable, every handler run is one span,
``mesh handler <queue>`` (kind CONSUMER), current while the handler runs (so
the handler's own spans are its children), with the attributes
``mesh.queue``, ``mesh.process.id``, ``mesh.token``, ``mesh.attempt`` (1 for
the first), ``mesh.persistent``, ``mesh.worker.id`` and ``mesh.outcome``
(``finished``, ``failed`` or ``cancelled``); a failure records the exception
and sets the span's status to ERROR. Without an SDK configured (no tracer
provider set), no span is made: the API's would do nothing, and making one
costs about 4 us per handler run.

When it is not installed, :data:`tracer` is None and the runner calls the
handler directly: the only cost is that one check per run.
"""

from __future__ import annotations

from typing import Any

import anyio

from ._types import Process

__all__ = ["active", "traced", "tracer"]

try:
    from opentelemetry import trace as _trace
except ImportError:
    _trace = None  # type: ignore[assignment]

#: The tracer handler spans come from, or None without OpenTelemetry.
tracer: Any = _trace.get_tracer("mesh") if _trace is not None else None

# Tracer providers of the API alone (no SDK configured): their spans record
# nothing, and making one per handler run cost about 4 us of CPU, a fifth of
# a busy worker's CPU per task, so none is made while one of these is in use.
_NO_SDK: tuple[type, ...] = (
    (_trace.ProxyTracerProvider, _trace.NoOpTracerProvider) if _trace is not None else ()
)


def active() -> bool:
    """Whether a handler span would record anything: OpenTelemetry is
    importable and an SDK tracer provider is set. Sync, cheap enough to ask
    once per claimed batch rather than once per handler run."""
    return _trace is not None and not isinstance(_trace.get_tracer_provider(), _NO_SDK)


async def traced(handler: Any, p: Process) -> Any:
    """``await handler(p)`` inside its span (see the module doc), returning
    what it returns (a queue with a result TTL keeps it). Whatever the
    handler raises (Cancelled included) propagates unchanged. While no SDK
    tracer provider is set (the API's own proxy or no-op one), no span is
    made: it would record nothing."""
    assert _trace is not None
    if isinstance(_trace.get_tracer_provider(), _NO_SDK):
        return await handler(p)
    attributes = {
        "mesh.queue": p.queue,
        "mesh.process.id": p.id,
        "mesh.token": p.token,
        "mesh.attempt": p.attempts + 1,
        "mesh.persistent": p.persistent,
        "mesh.worker.id": p.worker_id,
    }
    with tracer.start_as_current_span(
        f"mesh handler {p.queue}",
        kind=_trace.SpanKind.CONSUMER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            value = await handler(p)
        except anyio.get_cancelled_exc_class():
            span.set_attribute("mesh.outcome", "cancelled")
            raise
        except BaseException as exc:
            span.set_attribute("mesh.outcome", "failed")
            span.record_exception(exc)
            span.set_status(_trace.Status(_trace.StatusCode.ERROR, type(exc).__name__))
            raise
        span.set_attribute("mesh.outcome", "finished")
        return value
