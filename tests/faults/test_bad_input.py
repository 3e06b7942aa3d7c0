"""Bad input: any payload (binary, empty, up to the configured limit) round
trips byte for byte and cancels by value; one byte over the limit is refused
with nothing sent; duplicate worker ids, wrong types, a closed client and
calls after a worker stopped all fail cleanly, changing nothing."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mesh
from mesh import ClosedError, ConfigError, Process
from mesh._harness.harness import Harness
from mesh.testing import wait_until

from .conftest import TTL

MAX = 256 * 1024

small = st.binary(max_size=64)
text = st.text(max_size=32).map(str.encode)
large = st.builds(
    lambda seed, n: random.Random(seed).randbytes(n), st.integers(), st.integers(MAX - 64, MAX)
)
payload = st.one_of(st.just(b""), small, text, large)


class Seen:
    def __init__(self) -> None:
        self.oneshot: list[bytes] = []
        self.persistent: list[Process] = []
        self.cancelled: list[bytes] = []

    async def job(self, p: Process) -> None:
        self.oneshot.append(p.task)

    async def device(self, p: Process) -> None:
        self.persistent.append(p)
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled.append(p.task)
            raise


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    oneshot=st.lists(payload, min_size=1, max_size=6),
    persistent=st.lists(payload, min_size=1, max_size=4, unique=True),
)
async def test_any_payload_round_trips_and_cancels_by_value(
    redis_url: str, oneshot: list[bytes], persistent: list[bytes]
) -> None:
    ns = "bad" + random.randbytes(4).hex()
    seen = Seen()
    async with (
        mesh.open_client(redis_url, namespace=ns, max_payload=MAX) as client,
        mesh.open_worker(redis_url, namespace=ns, ttl=TTL, max_payload=MAX) as w,
    ):
        await w.start_work("jobs", seen.job)
        await w.start_work("devices", seen.device)
        assert await client.enqueue_many("jobs", oneshot) == len(oneshot)
        assert await client.ensure_many("devices", persistent) == [True] * len(persistent)
        assert await client.ensure_many("devices", persistent) == [False] * len(persistent)

        async def all_seen() -> bool:
            return len(seen.oneshot) == len(oneshot) and len(seen.persistent) == len(persistent)

        await wait_until(all_seen, 10, "every payload handled")
        assert sorted(seen.oneshot) == sorted(oneshot)  # byte for byte, duplicates included
        assert sorted(p.task for p in seen.persistent) == sorted(persistent)
        for p in persistent:
            assert await client.cancel("devices", p) == 1

        async def all_cancelled() -> bool:
            return len(seen.cancelled) == len(persistent)

        await wait_until(all_cancelled, 5, "every device cancelled by value")
        assert sorted(seen.cancelled) == sorted(persistent)
        assert await client.persistent_tasks("devices") == {}
        assert await client.processes() == []
        await client.delete_queue("jobs")
        await client.delete_queue("devices")


async def test_the_payload_limit_is_exact_and_nothing_is_sent_over_it(
    redis_url: str, namespace: str
) -> None:
    async with (
        mesh.open_client(redis_url, namespace=namespace, max_payload=MAX) as client,
        mesh.open_worker(redis_url, namespace=namespace, ttl=TTL, max_payload=MAX) as w,
    ):
        for c in (client, w.client):
            await c.enqueue("q", b"x" * MAX)
            with pytest.raises(ValueError, match="limit"):
                await c.enqueue("q", b"x" * (MAX + 1))
            with pytest.raises(ValueError, match="limit"):
                await c.enqueue_many("q", [b"ok", b"x" * (MAX + 1)])  # all or none
            with pytest.raises(ValueError, match="limit"):
                await c.ensure("p", "é" * (MAX // 2 + 1))  # counted in UTF-8 bytes
        assert await client.tasks("q") == [b"x" * MAX] * 2
        assert await client.persistent_tasks("p") == {}


async def test_duplicate_worker_ids_are_refused_while_the_id_is_held(h: Harness) -> None:
    (a,) = await h.start(1, "--worker-id", "dup")
    await h.client.ensure("devices", b"dev")
    first = await h.wait_event(lambda e: e.action == "start", 5, "A runs the device")
    b = h.spawn(None, "--worker-id", "dup")
    assert await b.wait_exit(10) == 2
    fail = next(e for e in await h.events() if e.action == "startfail" and e.tag == b.tag)
    assert fail.extra.startswith("ConfigError") and "in use" in fail.extra
    assert a.alive
    a.kill()
    # dead but not recycled yet (no peer): still refused
    c = h.spawn(None, "--worker-id", "dup")
    assert await c.wait_exit(10) == 2
    await h.start(1)  # a peer recycles the dead "dup" after its lease ran out

    async def gone() -> bool:
        return "dup" not in {w.id for w in await h.client.workers()}

    await wait_until(gone, 4 * TTL, "dup recycled")
    (d,) = await h.start(1, "--worker-id", "dup")
    assert d.alive
    ev = await h.events()
    assert all(e.token >= first.token for e in ev if e.fenced)
    assert (await h.judge()).overlaps == []


async def test_wrong_types_are_refused_before_anything_is_sent(
    redis_url: str, namespace: str
) -> None:
    bad_worker_kwargs: list[tuple[dict[str, Any], type[BaseException]]] = [
        ({"ttl": "1"}, TypeError),
        ({"ttl": 0}, ConfigError),
        ({"ttl": 1.0, "heartbeat_interval": 0.9}, ConfigError),
        ({"worker_id": 5}, TypeError),
        ({"worker_id": "a b"}, ConfigError),
        ({"namespace": None}, TypeError),
        ({"namespace": "{x}"}, ConfigError),
    ]
    for kw, exc in bad_worker_kwargs:
        args: dict[str, Any] = {"namespace": namespace, **kw}
        with pytest.raises(exc):
            async with mesh.open_worker(redis_url, **args):
                pass  # pragma: no cover
    with pytest.raises(ConfigError):
        async with mesh.open_client("http://127.0.0.1:1", namespace=namespace):
            pass  # pragma: no cover
    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as w,
    ):
        # ill-typed on purpose: through Any, as from untyped code
        c: Any = client
        wk: Any = w
        calls: list[tuple[Any, type[BaseException]]] = [
            (lambda: c.enqueue("q", 5), TypeError),
            (lambda: c.enqueue("q", None), TypeError),
            (lambda: c.enqueue_many("q", b"abc"), TypeError),
            (lambda: c.enqueue_many("q", [b"a", 1.5]), TypeError),
            (lambda: c.enqueue(5, b"x"), TypeError),
            (lambda: c.enqueue("bad queue", b"x"), ConfigError),
            (lambda: c.enqueue("", b"x"), ConfigError),
            (lambda: c.ensure("q", {"a": 1}), TypeError),
            (lambda: c.cancel("q", 7), TypeError),
            (lambda: c.tasks(None), TypeError),
            (lambda: wk.start_work("q", concurrency="2"), ConfigError),
            (lambda: wk.start_work("q", concurrency=0), ConfigError),
            (lambda: wk.start_work("q", max_attempts=-1), ConfigError),
            (lambda: wk.start_work("q", backoff=5, backoff_max=1), ConfigError),
            (lambda: wk.start_work("q", "not callable"), TypeError),
            (lambda: wk.dequeue("not served"), ConfigError),
            (lambda: wk.stop_work("not served"), ConfigError),
        ]
        for call, exc in calls:
            with pytest.raises(exc):
                await call()
        assert await client.queues() == []  # nothing was written
        assert await client.queue_length("q") == 0
        assert [x.id for x in await client.workers()] == [w.id]


async def test_a_closed_client_and_a_stopped_worker_refuse_every_call(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        pass
    closed_calls: list[Callable[[], Awaitable[object]]] = [
        lambda: client.enqueue("q", b"x"),
        lambda: client.enqueue_many("q", [b"x"]),
        lambda: client.ensure("q", b"x"),
        lambda: client.ensure_many("q", [b"x"]),
        lambda: client.reconcile("q", [b"x"]),
        lambda: client.cancel("q", b"x"),
        lambda: client.delete_queue("q"),
        lambda: client.queues(),
        lambda: client.tasks("q"),
        lambda: client.queue_length("q"),
        lambda: client.queue_info("q"),
        lambda: client.dead_letters("q"),
        lambda: client.persistent_tasks("q"),
        lambda: client.processes(),
        lambda: client.workers(),
    ]
    for call in closed_calls:
        with pytest.raises(ClosedError):
            await call()
    seen = Seen()
    async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as w:
        await w.start_work("q")
        await w.start_work("jobs", seen.job)
        await w.client.enqueue("q", b"x")
        p = await w.dequeue("q")
        assert p is not None
    assert w.statistics().worker_id == w.id  # still readable
    stopped_calls: list[Callable[[], Awaitable[object]]] = [
        lambda: w.start_work("other"),
        lambda: w.stop_work("q"),
        lambda: w.dequeue("q"),
        lambda: w.finish(p),
        lambda: w.give_back(p),
        lambda: w.client.enqueue("q", b"y"),
        lambda: w.client.queues(),
    ]
    for call in stopped_calls:
        with pytest.raises(ClosedError):
            await call()
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        # leaving handed the manual process back: the task is queued again
        assert await client.tasks("q") == [b"x"]
        assert await client.workers() == []
