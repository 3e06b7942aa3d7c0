"""The documentation: it builds with ``mkdocs build --strict``, it covers the
public API, the scripts and the subcommands, and what it tells users to run
(the quickstart programs, the ACL user) works against a real redis-server."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import mesh
from mesh._connection import open_connection
from mesh._errors import CommandError
from mesh.testing import RedisServer, wait_until

from .cli_helpers import assert_one_line_error, mesh_cli
from .helpers import server_kind

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def page(name: str) -> str:
    return (DOCS / name).read_text()


def code_blocks(text: str, lang: str) -> list[str]:
    """The fenced code blocks of ``text`` in language ``lang``."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def files_in(text: str) -> dict[str, str]:
    """Python blocks whose first line is ``# NAME.py``, by NAME."""
    out = {}
    for block in code_blocks(text, "python"):
        first, _, rest = block.partition("\n")
        m = re.fullmatch(r"# (\w+\.py)", first)
        if m:
            out[m.group(1)] = rest
    return out


def mesh_commands(text: str) -> list[list[str]]:
    """The ``mesh ...`` command lines of the ``sh`` blocks of ``text``, as argv
    lists without the program name."""
    out = []
    for block in code_blocks(text, "sh"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0].endswith("bin/mesh"):
                out.append(words[1:])
    return out


# --- the build ----------------------------------------------------------------


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:  # the test extra installs it
        pytest.fail("mkdocs is not installed (pip install -e '.[test]')")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "api" / "index.html").exists()
    api = (tmp_path / "api" / "index.html").read_text()
    # mkdocstrings rendered the docstrings, not just the headings
    assert "Join the mesh" in api and "Raises" in api
    contract = (tmp_path / "protocol-contract" / "index.html").read_text()
    assert "The trio-mesh protocol" in contract  # protocol/README.md was included


# --- coverage -------------------------------------------------------------------


def public_names() -> list[str]:
    tree = ast.parse((ROOT / "mesh" / "__init__.py").read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names += [a.asname or a.name for a in node.names]
    return [n for n in names if not n.startswith("_")]


def test_api_reference_has_every_public_name() -> None:
    names = public_names()
    assert "open_worker" in names and "Process" in names
    documented = set(re.findall(r"^::: mesh\.(\w+)$", page("api.md"), re.M))
    assert sorted(set(names) - documented) == []
    assert sorted(documented - set(names)) == []


def test_api_reference_documents_mesh_testing() -> None:
    import mesh.testing

    documented = set(re.findall(r"^::: mesh\.testing\.(\w+)$", page("api.md"), re.M))
    assert documented == set(mesh.testing.__all__)
    assert "run_redis_server" in documented


def test_protocol_page_names_every_script() -> None:
    text = page("protocol.md")
    scripts = sorted(p.name for p in (ROOT / "protocol").glob("*.lua"))
    assert len(scripts) >= 13
    assert [s for s in scripts if f"`{s}`" not in text] == []


def test_cli_page_has_every_subcommand() -> None:
    from mesh.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    headings = [line for line in page("cli.md").splitlines() if line.startswith("## ")]
    missing = [c for c in sub.choices if not any(f"`mesh {c}`" in h for h in headings)]
    assert missing == []


def test_the_node_readme_checks_its_peer_with_mesh_conformance() -> None:
    """Issue 32, item 16: the README ran the peer through a repository tool;
    it now gives the documented command, which the parser takes as written."""
    from mesh.cli import build_parser

    readme = (ROOT / "clients" / "node" / "README.md").read_text()
    assert "run_conformance" not in readme
    (line,) = [x for x in readme.splitlines() if x.startswith("mesh conformance ")]
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert args.command == "conformance"
    assert args.peer == "node clients/node/bin/mesh-peer.js"


def test_operating_md_names_the_dashboards_dead_letter_actions() -> None:
    """The dashboard serves requeue and purge of dead letters (its app's
    routes); operating.md once said it offered neither."""
    app = (ROOT / "mesh" / "dashboard" / "_app.py").read_text()
    assert "/api/dead/requeue" in app and "/api/dead/purge" in app
    text = page("operating.md")
    section = text[text.index("## Dashboard") :]
    section = " ".join(section[: section.index("\n## ", 1)].split())
    assert "requeue or purge all the dead letters of a queue" in section
    assert "not offered" not in section


def test_every_python_block_in_the_docs_parses() -> None:
    blocks = 0
    for path in sorted(DOCS.glob("*.md")):
        for block in code_blocks(path.read_text(), "python"):
            ast.parse(block, filename=str(path))
            blocks += 1
    assert blocks >= 4


# --- what the docs tell users to run ------------------------------------------


def acl_command(namespace: str, password: str) -> list[str]:
    """The ``ACL SETUSER`` line of operating.md, for ``namespace``."""
    (line,) = [
        ln
        for b in code_blocks(page("operating.md"), "text")
        for ln in b.splitlines()
        if ln.startswith("ACL SETUSER ")
    ]
    words = line.split()
    assert words[2] == "mesh-app" and words[4].startswith(">")
    words[4] = ">" + password
    if server_kind().version < (7,):
        # "On 6.2 leave the three out: Redis 6.2 refuses an ACL that names an
        # unknown command" (operating.md)
        sharded = ["+spublish", "+ssubscribe", "+sunsubscribe"]
        assert all(w in words for w in sharded), line
        words = [w for w in words if w not in sharded]
    return [w.replace("{mesh}", "{" + namespace + "}") for w in words]


async def test_the_acl_user_of_operating_md_can_run_a_mesh(
    own_redis: RedisServer, namespace: str
) -> None:
    async with open_connection(own_redis.url) as admin:
        assert await admin.execute(*acl_command(namespace, "s3cret")) == b"OK"
        await admin.execute("ACL", "LOG", "RESET")
        await admin.execute("SET", "outside", "1")
    url = own_redis.url.replace("redis://", "redis://mesh-app:s3cret@")
    seen: list[bytes] = []

    async def handler(p: mesh.Process) -> None:
        seen.append(p.task)
        if p.persistent:
            await trio.sleep_forever()

    async with mesh.open_worker(url, namespace=namespace, ttl=1.0) as worker:
        client = worker.client
        await worker.start_work("jobs", handler)
        await worker.start_work("conns", handler)
        await client.enqueue("jobs", "j1")
        assert (await client.reconcile("conns", ["c1", "c2"])).added == (b"c1", b"c2")
        # the job-queue features: a priority, a delay coming due, a rate limit
        await client.configure("jobs", rate_limit=100)
        await client.enqueue("jobs", "j2", priority=5)
        await client.enqueue_many("jobs", ["j3", "j4"], delay=0.05)
        # groups: settings, a pause, a delay, a cap reached and freed
        await client.configure_group("jobs", "t", concurrency=1, rate_limit=100, weight=2)
        await client.pause_group("jobs", "p")
        await client.enqueue_many("jobs", ["g1", "g2"], group="t")
        await client.enqueue("jobs", "g3", group="t", delay=0.05)
        await client.enqueue("jobs", "gp", group="p")
        # a payload over 1 MiB: uploaded, run whole, its blob dropped (protocol 10)
        big = b"big:" + b"x" * (1 << 21)
        await client.enqueue("jobs", big)
        await wait_until(lambda: len(seen) >= 10, what="10 tasks seen")
        assert big in seen
        assert {g.name for g in (await client.groups("jobs")).groups} == {"t", "p"}
        assert await client.cancel("jobs", "gp", group="p") == 1
        await client.resume_group("jobs", "p")
        assert [w.alive for w in await client.workers()] == [True]
        assert len(await client.processes()) == 2
        assert (await client.queue_info("conns")).running == 2
        # a page of jobs reads their extras (ZMSCORE of the unowned times)
        page = await client.jobs("conns", "running")
        assert sorted(j.task for j in page.jobs) == [b"c1", b"c2"]
        assert await client.persistent_tasks("conns") != {}
        assert await client.tasks("jobs") == [] and await client.dead_letters("jobs") == []
        assert await client.queues() == ["conns", "jobs"]
        assert await client.cancel("conns", "c1") == 1
        assert await client.delete_queue("conns") == 1
        await worker.stop_work("jobs")
        # the account really is confined to the namespace
        with pytest.raises(CommandError) as info:
            await client._conn.execute("GET", "outside")
        assert info.value.code == "NOPERM"

    async with open_connection(own_redis.url) as admin:
        log = await admin.execute("ACL", "LOG")
    denied = sorted({dict(zip(e[::2], e[1::2], strict=True))[b"object"] for e in log})
    # CONFIG is left out on purpose (the policy check reads INFO memory),
    # and the GET above was outside the namespace: the mesh needed nothing else
    assert denied == [b"outside"], log


@pytest.fixture
def quickstart(tmp_path: Path) -> Iterator[Path]:
    files = files_in(page("quickstart.md"))
    assert sorted(files) == ["service.py", "tasks.py"]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    yield tmp_path


def run_here(cwd: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MESH_REDIS_URL=url)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=30
    )


@pytest.mark.slow
def test_the_quickstart_does_what_it_says(quickstart: Path, own_redis: RedisServer) -> None:
    url = own_redis.url
    r = run_here(quickstart, url, "service.py")
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["done: daily", "done: weekly"]

    commands = mesh_commands(page("quickstart.md"))
    (start,) = [c for c in commands if c[0] == "worker"]
    feed = [c for c in commands if c[0] in ("ensure", "enqueue", "status")]
    cancels = [c for c in commands if c[0] == "cancel"]
    assert [c[0] for c in feed] == ["ensure", "enqueue", "status"] and len(cancels) == 1
    worker = subprocess.Popen(
        [sys.executable, "-m", "mesh.cli", *start],
        cwd=quickstart,
        env=dict(os.environ, MESH_REDIS_URL=url),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    async def settled(devices: set[bytes]) -> None:
        async with mesh.open_client(url) as client:

            async def done() -> bool:
                reports = await client.queue_info("reports")
                held = {p.task for p in await client.processes("devices")}
                return held == devices and reports.queued == reports.running == 0

            await wait_until(done, within=10, what="the quickstart's work done", every=0.02)

    try:
        for c in feed:
            r = run_here(quickstart, url, "-m", "mesh.cli", *c)
            assert r.returncode == 0, (c, r.stderr)
        trio.run(settled, {b"pump-1", b"pump-2", b"valve-7"})
        r = run_here(quickstart, url, "-m", "mesh.cli", *cancels[0])
        assert r.returncode == 0, r.stderr
        trio.run(settled, {b"pump-1", b"valve-7"})
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=10)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0, err
    lines = [line.split(": ", 1)[1] for line in out.splitlines()]
    assert "wrote report daily" in lines and "wrote report weekly" in lines
    assert "disconnected from pump-2" in lines
    assert any(line.startswith("connected to valve-7 (token ") for line in lines)


def test_the_asyncio_section_of_concepts_md_runs(redis_url: str, namespace: str) -> None:
    """The code of "Using the mesh from an asyncio program" does what it says
    under asyncio.run: the devices are held by asyncio handlers, the report's
    result comes back, and leaving the worker lets go of each device."""
    text = page("concepts.md")
    section = text[text.index("## Using the mesh from an asyncio program") :]
    (source,) = code_blocks(section, "python")[:1]
    assert 'URL = "redis://127.0.0.1:6379"' in source and 'namespace="app"' in source
    source = source.replace('"redis://127.0.0.1:6379"', repr(redis_url))
    source = source.replace('namespace="app"', f"namespace={namespace!r}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "concepts.md", "exec"), {"__name__": "concepts"})
    lines = out.getvalue().splitlines()
    assert "report daily" in lines, lines
    for device in ("pump-1", "valve-7"):
        assert any(line.startswith(f"connected to {device} (token ") for line in lines), lines
        assert f"disconnected from {device}" in lines, lines


def test_open_client_worker_and_fleet_outside_a_loop_say_so(redis_url: str) -> None:
    """Entered with no event loop running (a coroutine driven by hand), the
    openers fail at once with a sentence that names both loops."""
    openers: list[tuple[str, Callable[[str], Any]]] = [
        ("mesh.open_client", mesh.open_client),
        ("mesh.open_worker", mesh.open_worker),
        ("mesh.open_fleet", mesh.open_fleet),
    ]
    for name, opener in openers:

        async def enter(cm: Any) -> None:
            async with cm:
                raise AssertionError("entered outside a loop")

        coro = enter(opener(redis_url))
        with pytest.raises(mesh.ConfigError) as info:
            coro.send(None)
        message = str(info.value)
        assert message.startswith(f"{name} needs trio or asyncio and was called outside"), message
        assert "trio.run(...) or asyncio.run(...)" in message


@pytest.mark.slow
async def test_the_demo_under_the_documented_acl_says_what_it_misses(
    own_redis: RedisServer,
) -> None:
    """operating.md's ACL leaves SCAN out; ``mesh demo --redis`` needs it to
    remove its namespace. It used to fail at the end with Redis's bare
    NOPERM; it says which permission is missing and what to do, first."""
    async with open_connection(own_redis.url) as admin:
        assert await admin.execute(*acl_command("demo-*", "s3cret")) == b"OK"
    url = own_redis.url.replace("redis://", "redis://mesh-app:s3cret@")
    r = await mesh_cli("demo", "--redis", url)
    line = assert_one_line_error(r, 1)
    assert "may not run SCAN" in line and "ACL SETUSER mesh-app +scan" in line, line
    assert "nothing was written" in line and "s3cret" not in line
    async with open_connection(own_redis.url) as admin:
        assert await admin.execute("DBSIZE") == 0
