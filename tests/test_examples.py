"""The examples: each runs as a script, as a user would run it (a subprocess,
exit code and output), and its parts are tested in-process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import _support  # noqa: E402
import cancel_anywhere  # noqa: E402
import device_owners  # noqa: E402
import embedded_service  # noqa: E402
import job_queue  # noqa: E402


def run_script(
    name: str, *args: str, url: str | None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run ``examples/NAME.py``; with ``url`` as $MESH_REDIS_URL, or with no
    $MESH_REDIS_URL at all (the example then starts its own server)."""
    env = {k: v for k, v in os.environ.items() if k != "MESH_REDIS_URL"}
    if url is not None:
        env["MESH_REDIS_URL"] = url
    return subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def explain(r: subprocess.CompletedProcess[str]) -> str:
    return f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"


# --- device_owners: the device server ----------------------------------------


async def test_device_server_fences_sessions_and_commands_by_token() -> None:
    server = device_owners.DeviceServer()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        old = await device_owners.DeviceSession.open(port, "d1", 5, "peer-A")
        await old.command("one")
        new = await device_owners.DeviceSession.open(port, "d1", 7, "peer-B")
        assert server.connected("d1") is server.current["d1"]
        assert server.current["d1"].token == 7
        await new.command("two")
        with pytest.raises(device_owners.DeviceRejected, match="stale token 5 < 7"):
            await old.command("late")
        with pytest.raises(device_owners.DeviceRejected, match="stale token 6 < 7"):
            await device_owners.DeviceSession.open(port, "d1", 6, "peer-C")
        # other devices are independent
        other = await device_owners.DeviceSession.open(port, "d2", 1, "peer-C")
        await other.command("three")
        await new.aclose()
        await other.aclose()

        async def both_closed() -> bool:
            return server.connected("d1") is None and server.connected("d2") is None

        await _support.wait_until(both_closed, within=5, what="closes")
        nursery.cancel_scope.cancel()

    events = [(e.device, e.token, e.event) for e in server.entries]
    assert events == [
        ("d1", 5, "session"),
        ("d1", 5, "accepted"),
        ("d1", 7, "session"),
        ("d1", 7, "accepted"),
        ("d1", 5, "rejected"),
        ("d1", 5, "closed"),
        ("d1", 6, "refused"),
        ("d2", 1, "session"),
        ("d2", 1, "accepted"),
        ("d1", 7, "closed"),
        ("d2", 1, "closed"),
    ]
    assert server.entries[2].detail == "supersedes session 1"
    assert device_owners.count_overlaps(server.entries) == 0


def test_count_overlaps_sees_an_old_session_acting_after_a_new_one() -> None:
    def accepted(device: str, token: int) -> device_owners.Entry:
        return device_owners.Entry(0.0, device, token, token, "p", "accepted")

    ok = [accepted("d1", 1), accepted("d1", 1), accepted("d2", 1), accepted("d1", 2)]
    assert device_owners.count_overlaps(ok) == 0
    assert device_owners.count_overlaps([*ok, accepted("d1", 1), accepted("d2", 1)]) == 1


@pytest.mark.slow
def test_device_owners_script(redis_url: str, namespace: str) -> None:
    r = run_script("device_owners", "--namespace", namespace, url=redis_url)
    assert r.returncode == 0, explain(r)
    out = r.stdout
    assert out.rstrip().endswith("OK"), explain(r)
    assert "SIGKILL peer-" in out
    assert "is stopped (SIGSTOP)" in out
    assert "REJECTED" in out and "stale token" in out
    assert "rejoined as peer-" in out
    assert "sessions of one device acting at once: 0" in out
    assert "exit -9" in out  # the killed peer
    # every device moved twice: killed owner -> new owner, paused owner -> new owner
    assert out.count(" -> ") >= 2


# --- cancel_anywhere ------------------------------------------------------------


async def test_cancel_anywhere(redis_url: str, namespace: str) -> None:
    lines: list[str] = []
    report = await cancel_anywhere.run(redis_url, namespace=namespace, say=lines.append)
    film = cancel_anywhere.render_task
    assert report.of(film("film-2", 10_000)) == ["started", "cancelled"]
    assert report.of(film("film-4", 20)) == []  # cancelled while queued: never started
    assert report.of(film("film-1", 20)) == ["started", "finished"]
    assert report.of(film("film-3", 30)) == ["started", "finished"]
    assert (report.cancelled_queued, report.cancelled_running, report.cancelled_nothing) == (
        1,
        1,
        0,
    )
    # over pub/sub, not by a heartbeat (the default heartbeat interval is 1 s)
    assert report.latency < 0.5
    # three renders ran on three different workers
    workers = {w for w, _, e in report.events if e == "started"}
    assert len(workers) == 3
    assert any("cancelled at frame" in line for line in lines)


# --- job_queue ------------------------------------------------------------------


async def test_job_queue(redis_url: str, namespace: str) -> None:
    report = await job_queue.run(redis_url, namespace=namespace, say=lambda _: None)
    assert report.outcomes("email:alice") == ["ok"]
    assert report.outcomes("email:bob") == ["ok"]
    assert report.outcomes("charge:order-42") == ["GatewayTimeout", "GatewayTimeout", "ok"]
    assert report.outcomes("parse:{broken") == ["JSONDecodeError"] * job_queue.MAX_ATTEMPTS
    assert report.dead_letters == ["parse:{broken"]
    # the retries waited for the backoff: 0.2 s, then 0.4 s
    times = [t for t, _ in report.attempts["charge:order-42"]]
    assert times[1] - times[0] >= job_queue.BACKOFF - 0.01
    assert times[2] - times[1] >= 2 * job_queue.BACKOFF - 0.01


# --- embedded_service -----------------------------------------------------------


async def test_embedded_service(redis_url: str, namespace: str) -> None:
    report = await embedded_service.run(redis_url, namespace=namespace, say=lambda _: None)
    first, second, after_stop, last = report.holders
    assert sorted(first) == sorted(embedded_service.STEPS[0])
    assert sorted(second) == sorted(embedded_service.STEPS[1])
    assert sorted(after_stop) == sorted(second)
    assert report.stopped in second.values()
    assert report.stopped not in after_stop.values()  # all moved to the replica that stayed
    assert last == {}
    adds = sorted(a for _, added, _ in report.reconciled for a in added)
    cancels = sorted(c for _, _, cancelled in report.reconciled for c in cancelled)
    # each change reported once, by whichever replica made it
    assert adds == ["cache", "db-primary", "metrics", "search"]
    assert cancels == ["cache", "db-primary", "metrics", "search"]
    # the stopped replica handed its connections back: no lease timeout (3 s)
    assert report.handover < 1.0


# --- every example as a script ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cancel_anywhere", "job_queue", "embedded_service"])
def test_example_scripts(name: str, redis_url: str, namespace: str) -> None:
    r = run_script(name, "--namespace", namespace, url=redis_url)
    assert r.returncode == 0, explain(r)
    assert r.stdout.rstrip().endswith("OK"), explain(r)
    assert "throwaway redis-server" not in r.stdout  # it used $MESH_REDIS_URL


@pytest.mark.slow
def test_an_example_starts_its_own_redis_when_no_url_is_set() -> None:
    r = run_script("job_queue", url=None)
    assert r.returncode == 0, explain(r)
    assert "started a throwaway redis-server at redis://127.0.0.1:" in r.stdout
    assert ":6379" not in r.stdout
    assert r.stdout.rstrip().endswith("OK"), explain(r)
