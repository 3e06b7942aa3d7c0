"""OpenTelemetry: one span per handler run with its attributes and outcome
when the extra is installed; nothing imported, nothing done, when not."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import trio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import mesh
from mesh import _telemetry
from mesh.testing import wait_until

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)  # once per process: the API allows one
    yield EXPORTER
    provider.shutdown()  # later tests' handler runs export nothing
    EXPORTER.clear()


async def test_a_span_per_handler_run(
    spans: InMemorySpanExporter, redis_url: str, namespace: str
) -> None:
    spans.clear()
    inner = trace.get_tracer("app")

    async def handler(p: mesh.Process) -> None:
        with inner.start_as_current_span("app work"):
            pass
        if p.task == b"bad":
            raise ValueError("nope")
        if p.task == b"hold":
            await trio.sleep_forever()

    async with mesh.open_worker(redis_url, namespace=namespace, ttl=0.9) as w:
        await w.start_work("jobs", handler, max_attempts=2, backoff=0)
        await w.client.enqueue_many("jobs", ["ok", "bad", "hold"])

        def ours() -> list:  # type: ignore[type-arg]
            return [s for s in spans.get_finished_spans() if s.name == "mesh handler jobs"]

        await wait_until(lambda: len(ours()) >= 3)  # ok, bad, bad again
        await w.client.cancel("jobs", "hold")
        await wait_until(lambda: len(ours()) == 4)
    by_outcome: dict[str, list] = {}  # type: ignore[type-arg]
    for s in ours():
        by_outcome.setdefault(s.attributes["mesh.outcome"], []).append(s)
    assert sorted((k, len(v)) for k, v in by_outcome.items()) == [
        ("cancelled", 1),
        ("failed", 2),
        ("finished", 1),
    ]
    [ok] = by_outcome["finished"]
    assert ok.kind == trace.SpanKind.CONSUMER
    assert ok.attributes["mesh.queue"] == "jobs"
    assert ok.attributes["mesh.token"] == int(ok.attributes["mesh.process.id"])
    assert ok.attributes["mesh.attempt"] == 1
    assert ok.attributes["mesh.worker.id"] == w.id
    attempts = sorted(s.attributes["mesh.attempt"] for s in by_outcome["failed"])
    assert attempts == [1, 2]
    failed = by_outcome["failed"][0]
    assert failed.status.status_code == trace.StatusCode.ERROR
    assert failed.events[0].name == "exception"
    # the handler's own span is a child of the run's span
    [child] = [s for s in spans.get_finished_spans() if s.name == "app work"][:1]
    parents = {s.context.span_id for s in ours()}
    assert child.parent is not None and child.parent.span_id in parents


def test_without_opentelemetry_nothing_is_imported(redis_url: str) -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["opentelemetry"] = None  # as if not installed: import fails
        import trio, mesh, mesh._telemetry as t
        from mesh.testing import wait_until
        assert t.tracer is None
        done = []
        async def main():
            async with mesh.open_worker(sys.argv[1], namespace="no-otel", ttl=0.9) as w:
                async def handler(p):
                    done.append(p.task)
                await w.start_work("jobs", handler)
                await w.client.enqueue("jobs", "x")
                await wait_until(lambda: done, what="x done")
        trio.run(main)
        assert done == [b"x"]
        assert sys.modules["opentelemetry"] is None  # still never imported
        print("ok")
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code, redis_url], capture_output=True, text=True, timeout=60
    )
    assert r.stdout.strip() == "ok", r.stderr
    assert _telemetry.tracer is not None  # and here, with it installed, it is on


def test_no_span_without_an_sdk() -> None:
    """With the API installed but no SDK tracer provider set, a handler runs
    without a span being made (it would record nothing, and cost about 4 us
    per run); spans start once a provider is set."""
    code = textwrap.dedent(
        """
        import trio
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )
        from mesh import _telemetry
        from mesh._types import Process

        made = []
        real = _telemetry.tracer.start_as_current_span
        def spy(*args, **kwargs):
            made.append(args[0])
            return real(*args, **kwargs)
        _telemetry.tracer.start_as_current_span = spy
        ran = []
        async def handler(p):
            ran.append(p.id)
        p = Process("1", "q", b"x", 1, "w", False, 0, 0.0)
        trio.run(_telemetry.traced, handler, p)
        assert ran == ["1"] and made == [], (ran, made)
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        trio.run(_telemetry.traced, handler, p)
        assert ran == ["1", "1"] and made == ["mesh handler q"], made
        assert [s.name for s in exporter.get_finished_spans()] == ["mesh handler q"]
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "ok", r.stderr
