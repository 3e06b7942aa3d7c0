"""The conformance suite (protocol/conformance/) and ``mesh conformance``:
the Python peer passes it, the harness fails a broken peer with a report
that names the invariant, the vectors' checker names a vector that differs,
and a peer refuses a namespace of another protocol version."""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import trio

import mesh
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh.conformance import _suite, _vectors
from mesh.conformance._group_checks import check_serial, check_turns
from mesh.conformance._record import Interval, ScenarioFailed
from mesh.conformance._scenarios import Run
from mesh.testing import RedisServer

from .helpers import server_kind

ROOT = Path(__file__).resolve().parent.parent
BROKEN = ROOT / "tests" / "conformance_broken_peer.py"


async def conformance(*args: str, within: float = 240) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(within):
        return await trio.run_process(
            [sys.executable, "-m", "mesh.cli", "conformance", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )


def out(r: subprocess.CompletedProcess[bytes]) -> str:
    return (r.stdout + r.stderr).decode(errors="replace")


async def namespaces_left(url: str) -> list[bytes]:
    async with open_connection(url) as conn:
        keys: list[bytes] = await conn.execute("KEYS", "{conformance-*")
        return keys


async def test_the_python_peer_passes_the_whole_suite(own_redis: RedisServer) -> None:
    r = await conformance("--redis", own_redis.url)
    assert r.returncode == 0, out(r)
    assert "all passed" in r.stdout.decode(), out(r)
    for name in _suite.scenario_names():
        assert f"scenario {name}: ok" in r.stdout.decode(), out(r)
    # every namespace it used is gone again
    assert await namespaces_left(own_redis.url) == []


async def test_a_peer_that_does_not_hand_back_on_stop_fails(own_redis: RedisServer) -> None:
    peer = f"{shlex.quote(sys.executable)} {BROKEN} no-handback"
    r = await conformance("--redis", own_redis.url, "--peer", peer, "--only", "03_stop_hands_back")
    assert r.returncode == 1, out(r)
    err = r.stderr.decode()
    assert "FAIL scenario 03_stop_hands_back: graceful stop" in err, err
    assert "ended 'exited' on stop" in err, err
    assert "1 failed" in err, err


async def test_a_peer_that_repeats_a_token_fails(own_redis: RedisServer) -> None:
    peer = f"{shlex.quote(sys.executable)} {BROKEN} same-token"
    r = await conformance("--redis", own_redis.url, "--peer", peer, "--only", "01_oneshot")
    assert r.returncode == 1, out(r)
    err = r.stderr.decode()
    assert "FAIL scenario 01_oneshot: growing tokens: token 1 given twice" in err, err


# Each duty a peer could skip fails the scenario for it, with a line that
# says what was missing: (fault of tests/conformance_broken_peer.py, the part
# of the suite run, what the report must say).
WRONG_PEERS = [
    (
        "subscribe-only",
        "04_cancel",
        "FAIL scenario 04_cancel: cancel latency (pub/sub): step ",
        "a peer must SSUBSCRIBE as well as SUBSCRIBE",
    ),
    (
        "subscribe-only",
        "08_wake",
        "FAIL scenario 08_wake: wake latency (pub/sub):",
        "a peer must SSUBSCRIBE as well as SUBSCRIBE",
    ),
    ("no-ticks", "09_ticks", "FAIL scenario 09_ticks: ticks:", "3 handler runs of queue tick"),
    (
        "no-results",
        "10_results",
        "FAIL scenario 10_results: results:",
        "the result record of 'r0' (queue kept) should hold 'r0'",
    ),
    (
        "no-timeout",
        "11_timeout",
        "FAIL scenario 11_timeout: handler timeout:",
        "should have stopped with reason 'timeout'",
    ),
    (
        "no-pause",
        "12_pause",
        "FAIL scenario 12_pause: pause:",
        "started in a window in which none may (",
    ),
    (
        "no-rate",
        "13_rate_limit",
        "FAIL scenario 13_rate_limit: rate limit:",
        "its rate limit lets at most 2 per 1 s through",
    ),
    (
        "no-stats",
        "14_stats",
        "FAIL scenario 14_stats: per-minute counts:",
        "should count 5 finished processes",
    ),
    (
        "number-tokens",
        "15_big_tokens",
        "FAIL scenario 15_big_tokens: line protocol:",
        "must be a string of decimal digits, got 90071992547409",
    ),
    (
        "double-tokens",
        "15_big_tokens",
        "FAIL scenario 15_big_tokens: growing tokens:",
        "9007199254740996 given twice",
    ),
    (
        "group-blind",
        "16_groups",
        "FAIL scenario 16_groups: group turns:",
        "claims take turns among the groups with jobs ready",
    ),
    (
        "old-version",
        "16_groups",
        "FAIL scenario 16_groups: start:",
        "namespace holds protocol version 11, this client speaks 10",
    ),
    (
        "blob-blind",
        "17_big_payloads",
        "FAIL scenario 17_big_payloads: big payload run:",
        "should hold the whole payload of 3145728 bytes",
    ),
    (
        "bad-loader",
        "vectors",
        "FAIL vector cancel.json",
        "the peer's loader expands cancel.lua to a script of SHA-1",
    ),
]


@pytest.mark.parametrize(
    ("fault", "only", "line", "says"), WRONG_PEERS, ids=[f"{w[0]}-{w[1]}" for w in WRONG_PEERS]
)
async def test_a_peer_that_skips_a_duty_fails_its_scenario(
    own_redis: RedisServer, fault: str, only: str, line: str, says: str
) -> None:
    peer = f"{shlex.quote(sys.executable)} {BROKEN} {fault}"
    r = await conformance("--redis", own_redis.url, "--peer", peer, "--only", only, "-q")
    if fault == "subscribe-only" and server_kind().version < (7,):
        # Redis 6.2 has no sharded pub/sub: every peer subscribes plainly
        # there, so a peer that never SSUBSCRIBEs does what it must
        assert r.returncode == 0, out(r)
        assert b"all passed" in r.stdout, out(r)
        return
    assert r.returncode == 1, out(r)
    err = r.stderr.decode()
    assert line in err, err
    assert says in err, err


async def test_usage_errors_exit_2(own_redis: RedisServer) -> None:
    r = await conformance()
    assert r.returncode == 2, out(r)
    assert "--redis" in r.stderr.decode()
    r = await conformance("--redis", own_redis.url, "--peer", "no-such-program-here")
    assert r.returncode == 2, out(r)
    assert "no such program: no-such-program-here" in r.stderr.decode()
    r = await conformance("--redis", own_redis.url, "--only", "vectors,nonsense")
    assert r.returncode == 2, out(r)
    assert "unknown name(s) nonsense" in r.stderr.decode()
    r = await conformance("--redis", "http://nowhere")
    assert r.returncode == 2, out(r)


async def test_the_vectors_match_and_a_changed_one_is_named(redis_url: str, namespace: str) -> None:
    vectors = _vectors.load_vectors(_suite.suite_dir() / "vectors")
    scripts = {v["script"] for _, v in vectors}
    assert scripts == {p.stem for p in (ROOT / "protocol").glob("*.lua")} - {"lib"}
    async with open_connection(redis_url) as conn:
        assert await _vectors.check_vectors(conn, vectors, namespace) == []
        # a vector whose recorded reply differs is reported by file and name
        file, claim = next((f, v) for f, v in vectors if v["name"] == "claim-two")
        wrong = copy.deepcopy(claim)
        wrong["reply"][0] = 99
        wrong["after"].pop("{ns}:token")
        (bad,) = await _vectors.check_vectors(conn, [(file, wrong)], namespace)
        assert (bad.file, bad.vector) == ("claim.json", "claim-two")
        assert "expected reply [99" in bad.what
        assert "key {ns}:token should not exist" in bad.what
        assert await _vectors.dump(conn, namespace) == {}


async def test_a_vector_pins_the_redis_time(redis_url: str, namespace: str) -> None:
    (_, reg) = next(
        x
        for x in _vectors.load_vectors(_suite.suite_dir() / "vectors")
        if x[1]["name"] == "register-new"
    )
    async with open_connection(redis_url) as conn:
        _, after = await _vectors.replay(conn, reg, namespace)
    deadline = reg["time"][0] * 1000 + reg["time"][1] // 1000 + int(reg["args"][2])
    assert after["{ns}:workers"]["value"] == [["w1", str(deadline)]]


async def test_the_python_peer_refuses_another_protocol_version(
    redis_url: str, namespace: str
) -> None:
    async with open_connection(redis_url) as conn:
        await conn.execute("SET", f"{{{namespace}}}:version", "6")
        with pytest.raises(
            mesh.ProtocolError,
            match=f"protocol version 6, this client speaks {mesh.PROTOCOL_VERSION}$",
        ):
            async with mesh.open_worker(redis_url, namespace=namespace, ttl=1.5):
                pass  # pragma: no cover
        # the line-protocol peer says so in an error event and exits 3
        env = dict(os.environ, MESH_REDIS_URL=redis_url, MESH_NAMESPACE=namespace)
        with trio.fail_after(30):
            r = await trio.run_process(
                [sys.executable, "-m", "mesh.conformance.peer"],
                stdin=b'{"op":"start","ttl":1.5}\n',
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=env,
            )
        assert r.returncode == 3, out(r)
        (event,) = [json.loads(line) for line in r.stdout.splitlines()]
        assert event["event"] == "error" and event["code"] == "VERSION", event
        assert "protocol version 6" in event["message"], event
        assert await conn.execute("GET", f"{{{namespace}}}:version") == b"6"


def record(run: Run, peer: str, t: float, **event: object) -> None:
    run._record(run.peers[peer], run.t0 + t, dict(event, queue="p", task="t"))


def synthetic_run() -> Run:
    scenario = {"name": "synthetic", "peers": {"a": "test", "b": "test"}, "steps": []}
    return Run(scenario, "", cast(Any, None), "", "x", lambda _: None)


async def test_the_checker_reports_two_owners_at_once_and_a_token_that_does_not_grow() -> None:
    run = synthetic_run()
    record(run, "a", 1.0, event="start", token="5", worker="wa")
    record(run, "b", 1.5, event="start", token="4", worker="wb")
    record(run, "a", 2.0, event="stop", token="5", reason="moved")
    record(run, "b", 3.0, event="stop", token="4", reason="stopped")
    run.check()
    found = {(f.invariant, f.evidence.split(":")[0]) for f in run.failures}
    assert ("one owner", "'t' of queue p ran twice at once for 0.500 s") in found, run.failures
    assert ("growing tokens", "'t' of queue p") in found, run.failures


async def test_the_checker_does_not_count_a_stopped_peer_until_it_reports_fenced() -> None:
    run = synthetic_run()
    record(run, "a", 1.0, event="start", token="5", worker="wa")
    run.peers["a"].paused.append([run.t0 + 1.2, run.t0 + 4.0])  # SIGSTOP .. SIGCONT
    record(run, "b", 3.0, event="start", token="6", worker="wb")
    record(run, "a", 4.1, event="stop", token="5", reason="fenced")
    record(run, "b", 5.0, event="stop", token="6", reason="stopped")
    run.check()
    assert run.failures == []
    # the same, but it ran on for a second after SIGCONT: two owners
    run = synthetic_run()
    record(run, "a", 1.0, event="start", token="5", worker="wa")
    run.peers["a"].paused.append([run.t0 + 1.2, run.t0 + 4.0])
    record(run, "b", 3.0, event="start", token="6", worker="wb")
    record(run, "a", 5.0, event="stop", token="5", reason="fenced")
    record(run, "b", 6.0, event="stop", token="6", reason="stopped")
    run.check()
    assert [f.invariant for f in run.failures] == ["one owner"], run.failures


async def test_no_task_is_handed_back_while_its_handler_runs_past_the_stop_grace(
    redis_url: str, namespace: str
) -> None:
    """The stop-grace rule of protocol/README.md (stop order) and
    docs/guarantees.md: a handler still running at the grace keeps its
    process; it is handed back only once the handler exited."""
    keys = Keys(namespace)
    began = trio.Event()
    exited: list[float] = []

    async def handler(p: mesh.Process) -> None:
        began.set()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(1.5)  # a slow clean-up, three times the grace
            exited.append(trio.current_time())

    seen: list[tuple[float, int, int]] = []  # (when, processes held, tasks queued)

    async def watch(conn: Connection) -> None:
        while not exited:
            held, queued = await conn.pipeline(
                [("HLEN", keys.procs("g")), ("LLEN", keys.queue("g"))]
            )
            seen.append((trio.current_time(), held, queued))
            await trio.sleep(0.05)

    async with (
        open_connection(redis_url) as conn,
        mesh.open_client(redis_url, namespace=namespace) as client,
        trio.open_nursery() as nursery,
    ):
        async with mesh.open_worker(
            redis_url, namespace=namespace, ttl=3.0, stop_grace=0.5
        ) as worker:
            await worker.start_work("g", handler, concurrency=1)
            await client.ensure("g", "slow")
            with trio.fail_after(10):
                await began.wait()
            stop_began = trio.current_time()
            nursery.start_soon(watch, conn)
        # leaving open_worker waited for the handler (trio cannot abandon it)
        assert exited
        past_grace = [s for s in seen if stop_began + 0.6 < s[0] < exited[0]]
        assert len(past_grace) >= 5, seen
        assert all(held == 1 and queued == 0 for _, held, queued in past_grace), past_grace
        # once the handler exited, the task was handed back (not lost)
        assert await conn.execute("HLEN", keys.procs("g")) == 0
        assert await client.persistent_tasks("g") == {b"slow": None}


async def test_a_policy_is_compared_by_what_it_decodes_to(redis_url: str, namespace: str) -> None:
    """cjson.encode's key order differs between servers (Valkey): a vector
    whose policy JSON has its keys in another order still matches; one with
    another value does not."""
    file, vector = next(
        (f, v)
        for f, v in _vectors.load_vectors(_suite.suite_dir() / "vectors")
        if v["name"] == "configure-set"
    )
    reordered = copy.deepcopy(vector)
    policy = json.loads(vector["reply"])
    shuffled = json.dumps(dict(reversed(list(policy.items()))), separators=(",", ":"))
    assert shuffled != vector["reply"]
    reordered["reply"] = shuffled
    (field,) = reordered["after"]["{ns}:policy"]["value"]
    reordered["after"]["{ns}:policy"]["value"][field] = shuffled
    async with open_connection(redis_url) as conn:
        assert await _vectors.check_vectors(conn, [(file, reordered)], namespace) == []
        wrong = copy.deepcopy(reordered)
        wrong["reply"] = json.dumps(dict(policy, result_ttl_ms=1))
        (bad,) = await _vectors.check_vectors(conn, [(file, wrong)], namespace)
        assert "expected reply" in bad.what, bad


def _run(task: str, start: float, end: float, peer: str = "a") -> Interval:
    return Interval(peer, "gs", task, 1, "w", start, end, "done")


def test_a_group_of_concurrency_1_that_overlaps_or_reorders_fails_check_serial() -> None:
    step = {"queue": "gs", "tasks": ["s1", "s2", "s3"]}
    check_serial([_run("s1", 0, 1), _run("s2", 1.02, 2, "py"), _run("s3", 2, 3)], step)
    with pytest.raises(ScenarioFailed, match=r"'s1' \(peer a\) and 's2' \(peer py\).*ran at once"):
        check_serial([_run("s1", 0, 1), _run("s2", 0.5, 2, "py"), _run("s3", 2, 3)], step)
    with pytest.raises(ScenarioFailed, match=r"started in the order \['s2', 's1', 's3'\]"):
        check_serial([_run("s2", 0, 1), _run("s1", 1, 2), _run("s3", 2, 3)], step)
    with pytest.raises(ScenarioFailed, match=r"jobs \['s3'\] of queue gs never started"):
        check_serial([_run("s1", 0, 1), _run("s2", 1, 2)], step)


def test_claims_that_do_not_take_turns_fail_check_turns() -> None:
    groups = {g: [f"{g}{i}" for i in range(1, 6)] for g in ("a", "b")}
    step: dict[str, Any] = {"queue": "gs", "groups": groups, "rounds": 5}
    # turns of up to the quantum (3 by default, the protocol's turn) pass
    ok = ["b1", "a1", "a2", "a3", "a4", "b2", "b3", "b4", "a5", "b5"]
    check_turns([_run(t, i, i + 1) for i, t in enumerate(ok)], step)
    blind = ["a1", "a2", "a3", "a4", "a5", "b1", "b2", "b3", "b4", "b5"]
    with pytest.raises(ScenarioFailed, match=r"after \['a1', 'a2', 'a3', 'a4'\] of queue gs"):
        check_turns([_run(t, i, i + 1) for i, t in enumerate(blind)], step)
    with pytest.raises(ScenarioFailed, match=r"one group had started 1 jobs more"):
        check_turns([_run(t, i, i + 1) for i, t in enumerate(ok)], step | {"quantum": 0})
    with pytest.raises(ScenarioFailed, match="3 jobs of queue gs started, 10 expected"):
        check_turns([_run("a1", 0, 1), _run("b1", 1, 2), _run("a2", 2, 3)], step)
