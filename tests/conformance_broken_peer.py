"""A deliberately wrong peer of the conformance line protocol, to show that
the harness catches one (tests/test_conformance.py). It is the Python peer
with one fault, named by its first argument:

- ``no-handback``: ``stop`` writes ``stopped`` and exits at once, without
  stopping its handlers or handing their tasks back (peers get them only
  when its lease runs out).
- ``same-token``: every ``start`` event names token "1", as a peer that keeps
  one fencing token would.
- ``number-tokens``: tokens are written as JSON numbers, not strings.
- ``double-tokens``: tokens are strings, but went through a double (as
  ``Number(id)`` in JavaScript would): above 2^53 they name no process.
- ``subscribe-only``: subscribes its channels with ``SUBSCRIBE`` only, never
  ``SSUBSCRIBE``: on Redis 7+ it hears no wake and no cancel message, only
  the inbox and the work its heartbeats report.
- ``no-ticks``: fires no periodic task.
- ``no-results``: writes no result records (as if every policy's result TTL
  were 0).
- ``no-timeout``: ignores the queues' handler timeouts.
- ``no-rate``: ignores the queues' rate limits (passes none to claims).
- ``no-pause``: ignores pauses (passes another key as the pause flag).
- ``no-stats``: sends no per-minute counts.
- ``group-blind``: ignores the ``group`` of an ``enqueue`` command (its
  tasks go to the queue's own list, as a peer that knows no groups would).
- ``old-version``: registers as protocol version 10 (before a group
  without a cap stopped counting its jobs running): a namespace of version
  11 refuses it.
- ``blob-blind``: hands a handler a big payload's stand-in, not the payload
  (it never reads the blob).
- ``bad-loader``: its script loader ends lines with CRLF: the scripts still
  run, but are not the protocol's bytes (another SHA-1).

Each fault is the reference peer with something taken away, by replacing
one of the library's functions in this process before the worker starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.abc
import attrs
import trio

import mesh._binding
import mesh._history
import mesh._host
import mesh._keys
import mesh._policy
import mesh._pool
import mesh._pubsub
from mesh._scripts import Script, load_scripts
from mesh.conformance import peer as reference

FAULTS = (
    "no-handback",
    "same-token",
    "number-tokens",
    "double-tokens",
    "subscribe-only",
    "no-ticks",
    "no-results",
    "no-timeout",
    "no-rate",
    "no-pause",
    "no-stats",
    "bad-loader",
    "group-blind",
    "old-version",
    "blob-blind",
)


class BrokenPeer(reference.Peer):
    def __init__(self, url: str, namespace: str, fault: str) -> None:
        super().__init__(url, namespace)
        self.fault = fault

    def emit(self, **event: Any) -> None:
        if "token" in event:
            if self.fault == "same-token":
                event["token"] = "1"
            elif self.fault == "number-tokens":
                event["token"] = int(event["token"])
            elif self.fault == "double-tokens":
                event["token"] = str(int(float(event["token"])))
        super().emit(**event)

    async def _command(self, line: bytes, nursery: anyio.abc.TaskGroup) -> bool:
        if self.fault == "no-handback" and b'"stop"' in line:
            self.emit(event="stopped")
            os._exit(0)
        if self.fault == "group-blind" and b'"enqueue"' in line:
            cmd = json.loads(line)
            cmd.pop("group", None)
            line = json.dumps(cmd).encode()
        return await super()._command(line, nursery)


def _without(field: str) -> None:
    """Every policy this process reads has ``field`` 0."""
    original = mesh._policy.QueuePolicy.__attrs_post_init__

    def post_init(self: mesh._policy.QueuePolicy) -> None:
        original(self)
        object.__setattr__(self, field, 0 if field == "rate_limit" else 0.0)

    mesh._policy.QueuePolicy.__attrs_post_init__ = post_init  # type: ignore[method-assign]


def break_library(fault: str) -> None:
    if fault == "subscribe-only":
        subscribe = mesh._pubsub.PubSub.subscribe

        async def plain(self: mesh._pubsub.PubSub, *channels: Any, sharded: bool = False) -> None:
            await subscribe(self, *channels)

        mesh._pubsub.PubSub.subscribe = plain  # type: ignore[method-assign]
    elif fault == "no-ticks":

        async def no_scheduler(*args: Any, **kwargs: Any) -> None:
            await anyio.sleep_forever()

        setattr(mesh._host, "run_scheduler", no_scheduler)  # noqa: B010 (a module attribute)
    elif fault == "no-results":
        _without("result_ttl")
    elif fault == "no-timeout":
        _without("timeout")
    elif fault == "no-rate":
        _without("rate_limit")
    elif fault == "no-pause":
        mesh._keys.Keys.paused = lambda self, q: f"{self.prefix}not-paused:{q}"  # type: ignore[method-assign]
    elif fault == "no-stats":

        async def no_report(self: Any) -> bool:
            return True

        mesh._history.CountsReporter.report = no_report  # type: ignore[method-assign]
    elif fault == "blob-blind":

        async def stand_in(self: Any, p: mesh.Process) -> mesh.Process:
            return p

        mesh._pool.HandlerPool._resolve = stand_in  # type: ignore[method-assign]
    elif fault == "old-version":
        setattr(mesh._binding, "PROTOCOL_VERSION", "10")  # noqa: B010 (a module attribute)
    elif fault == "bad-loader":
        scripts = load_scripts()

        def crlf() -> Mapping[str, Script]:
            return {
                name: attrs.evolve(s, source=src, sha=hashlib.sha1(src).hexdigest())
                for name, s in scripts.items()
                for src in [s.source.replace(b"\n", b"\r\n")]
            }

        setattr(reference, "load_scripts", crlf)  # noqa: B010 (a module attribute)


def main() -> int:
    fault = sys.argv[1]
    if fault not in FAULTS:
        print(f"unknown fault {fault!r}", file=sys.stderr)
        return 2
    break_library(fault)
    peer = BrokenPeer(os.environ["MESH_REDIS_URL"], os.environ["MESH_NAMESPACE"], fault)
    trio.run(peer.run)
    return peer.exit_code


if __name__ == "__main__":
    sys.exit(main())
