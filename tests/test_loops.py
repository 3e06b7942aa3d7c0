"""trio-mesh on each event loop: the loop is found at call time, handlers are
coroutine functions of that loop, a move's reason reaches a handler on both,
uvloop runs a worker, and ``mesh worker --loop`` serves handlers of the loop
it names."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
import sniffio
import uvloop

import mesh
from mesh._loop import run
from mesh.testing import RedisServer, wait_until

from .cli_helpers import assert_one_line_error, clean_env, mesh_cli, running_process, stderr_until

pytestmark = pytest.mark.both_loops


async def test_handlers_run_on_the_loop_of_the_worker(
    redis_url: str, namespace: str, mesh_loop: str
) -> None:
    loops: list[str] = []

    async def job(p: mesh.Process) -> None:
        loops.append(sniffio.current_async_library())

    async with mesh.open_worker(redis_url, namespace=namespace) as w:
        await w.start_work("jobs", job)
        await w.client.enqueue_many("jobs", ["a", "b", "c"])
        await wait_until(lambda: len(loops) == 3, what="three jobs ran")
    assert loops == [mesh_loop] * 3


async def test_a_handler_moved_to_a_peer_is_told_so_on_either_loop(
    redis_url: str, namespace: str
) -> None:
    reasons: dict[bytes, str | None] = {}
    held: dict[str, set[bytes]] = {"a": set(), "b": set()}

    def hold(name: str) -> mesh.Handler:
        async def run(p: mesh.Process) -> None:
            held[name].add(p.task)
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class() as exc:
                reasons[p.task] = mesh.cancel_reason(exc)
                raise
            finally:
                held[name].discard(p.task)

        return run

    devices = [f"d{i}" for i in range(6)]
    async with mesh.open_worker(redis_url, namespace=namespace, ttl=1.5) as a:
        await a.start_work("devices", hold("a"))
        await a.client.ensure_many("devices", devices)
        await wait_until(lambda: len(held["a"]) == 6, what="A holds every device")
        async with mesh.open_worker(redis_url, namespace=namespace, ttl=1.5) as b:
            await b.start_work("devices", hold("b"))
            await wait_until(lambda: len(held["b"]) == 3, 10, "B holds its share")
            assert set(reasons.values()) == {mesh.MOVED} and len(reasons) == 3


def test_a_worker_runs_on_uvloop(redis_url: str, namespace: str) -> None:
    ran: list[tuple[str, bool]] = []

    async def job(p: mesh.Process) -> bytes:
        loop = asyncio.get_running_loop()
        ran.append((p.task.decode(), isinstance(loop, uvloop.Loop)))
        return p.task.upper()

    async def main() -> bytes | None:
        async with mesh.open_worker(redis_url, namespace=namespace) as w:
            await w.client.configure("jobs", result_ttl=60)
            await w.start_work("jobs", job)
            await w.client.enqueue("jobs", "x")
            return await w.client.result("jobs", "x", timeout=10)

    assert uvloop.run(main()) == b"X"
    assert ran == [("x", True)]


APP = textwrap.dedent(
    """
    import asyncio
    import sniffio

    async def job(p):
        await asyncio.sleep(0.01)  # an asyncio call: fails under trio
        print("ran", p.task.decode(), sniffio.current_async_library(), flush=True)

    async def device(p):
        try:
            await asyncio.Event().wait()
        finally:
            print("let go of", p.task.decode(), flush=True)

    queues = {"jobs": job, "devices": device}
    """
)


@pytest.mark.slow
@pytest.mark.trio_only("runs `mesh worker` as a process: the test's own loop does not matter")
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_mesh_worker_loop_serves_asyncio_handlers_and_stops_on_sigterm(
    redis_url: str, namespace: str, tmp_path: Path, loop: str
) -> None:
    (tmp_path / "aio_app.py").write_text(APP)
    env = clean_env(MESH_REDIS_URL=redis_url, MESH_NAMESPACE=namespace)
    argv = [sys.executable, "-m", "mesh.cli", "worker", "aio_app:queues", "--loop", loop]
    async with running_process(argv, env=env, cwd=tmp_path, stdout=-1, stderr=-1) as proc:
        await stderr_until(proc, rb"serves ")
        r = await mesh_cli("enqueue", "jobs", "a", "b", env=env)
        assert r.returncode == 0, r.stderr
        r = await mesh_cli("ensure", "devices", "d1", env=env)
        assert r.returncode == 0, r.stderr
        await stderr_until(proc, rb"start devices 'd1'")
        async with mesh.open_client(redis_url, namespace=namespace) as client:

            async def jobs_done() -> bool:
                return await client.queue_length("jobs") == 0 and not [
                    p for p in await client.processes("jobs")
                ]

            await wait_until(jobs_done, 10, "both jobs done")
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0
        assert proc.stdout is not None
        out = b""
        while chunk := await proc.stdout.receive_some():
            out += chunk
    lines = out.decode().splitlines()
    assert sorted(lines[:2]) == ["ran a asyncio", "ran b asyncio"], lines
    assert "let go of d1" in lines


@pytest.mark.trio_only("runs `mesh worker` as a process: the test's own loop does not matter")
async def test_mesh_worker_loop_rejects_an_unknown_loop(tmp_path: Path) -> None:
    r = await mesh_cli("worker", "aio_app:queues", "--loop", "gevent", cwd=tmp_path)
    line = assert_one_line_error(r, 2)
    assert "--loop" in line and "gevent" in line, line


@pytest.mark.slow
@pytest.mark.trio_only(
    "runs the suite and its peers as processes: the test's own loop does not matter"
)
async def test_the_python_peer_on_asyncio_passes_the_conformance_suite(
    own_redis: RedisServer,
) -> None:
    peer = f"{sys.executable} -m mesh.conformance.peer --loop asyncio"
    argv = [sys.executable, "-m", "mesh.cli", "conformance", "--quiet"]
    argv += ["--redis", own_redis.url, "--peer", peer]
    with anyio.fail_after(600):  # the whole suite: about a minute alone here
        r = await anyio.run_process(argv, env=clean_env(), check=False)
    out = r.stdout.decode()
    assert r.returncode == 0, out + r.stderr.decode()
    assert out.rstrip().endswith("all passed"), out


def test_run_names_an_unknown_loop_and_runs_nothing() -> None:
    ran: list[bool] = []

    async def body() -> None:
        ran.append(True)

    with pytest.raises(mesh.ConfigError, match="unknown event loop 'gevent': use one of trio"):
        run("gevent", body)
    assert ran == []
    assert run("asyncio", _answer) == run("trio", _answer) == 42


async def _answer() -> int:
    return 42
