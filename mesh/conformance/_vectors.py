"""Script vectors (``protocol/conformance/vectors/*.json``): replay one script
call on a given keyspace at a given Redis time and compare the reply and the
keyspace after with the recorded ones.

A vector is a JSON object (see protocol/conformance/README.md, "Script
vectors"): ``script``, ``name``, ``time`` ([seconds, microseconds]: what
``TIME`` answers inside the call), ``before`` and ``after`` (keyspaces),
``keys``, ``args``, and ``reply`` or ``error``. Key names and arguments use
the namespace ``ns`` (``{ns}:...``); a replay substitutes its own.

The time is fixed by a prelude (:data:`TIME_PRELUDE`) put before the
expanded script: it shadows ``redis`` with a table whose ``call`` and
``pcall`` answer ``TIME`` with the vector's time and pass everything else
on. Every other command runs on the real server.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from mesh._errors import CommandError
from mesh._scripts import load_scripts

TIME_PRELUDE = (
    "local __mesh_redis = redis\n"
    "local redis = setmetatable({\n"
    "  call = function(cmd, ...)\n"
    "    if cmd == 'TIME' or cmd == 'time' then return {'%(s)d', '%(us)d'} end\n"
    "    return __mesh_redis.call(cmd, ...)\n"
    "  end,\n"
    "  pcall = function(cmd, ...)\n"
    "    if cmd == 'TIME' or cmd == 'time' then return {'%(s)d', '%(us)d'} end\n"
    "    return __mesh_redis.pcall(cmd, ...)\n"
    "  end,\n"
    "}, {__index = __mesh_redis})\n"
)
"""Lua put before a script so that ``TIME`` answers the vector's time (one
line per statement; the script's own lines follow)."""

PLACEHOLDER = "ns"
"""The namespace vectors are written in."""

ELAPSED = "\0elapsed ms"
"""Not a key: how long a replay took (see :data:`TTL_TOLERANCE_MS`)."""

TTL_TOLERANCE_MS = 1000
"""A key's remaining TTL after the call may differ this much from the
recorded one (the recorded one was read right after the call too), plus
the time the replay took from loading the keys to reading them back (on a
loaded machine, or through a peer's own loader, that can be long)."""

_SUFFIX = re.compile(r"\s*script: \S+, on @user_script:\d+\.?$")


class Executor(Protocol):
    async def execute(self, *args: Any) -> Any: ...


@attrs.define
class Mismatch:
    file: str
    vector: str
    what: str


def text(value: Any) -> Any:
    """A reply as JSON: bytes as text (UTF-8), lists as lists."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "backslashreplace")
    if isinstance(value, list | tuple):
        return [text(v) for v in value]
    return value


def error_text(exc: CommandError) -> str:
    """An error reply without the location Redis 7 appends to script errors."""
    return strip_location(str(exc))


def strip_location(message: str) -> str:
    """An error message without the ``script: ..., on @user_script:N.`` that
    Redis 7 appends to a script's error reply."""
    return _SUFFIX.sub("", message)


def rename(value: Any, old: str, new: str) -> Any:
    """``value`` (JSON) with ``{old}`` replaced by ``{new}`` in every string."""
    a, b = "{" + old + "}", "{" + new + "}"
    if isinstance(value, str):
        return value.replace(a, b)
    if isinstance(value, list):
        return [rename(v, old, new) for v in value]
    if isinstance(value, dict):
        return {rename(k, old, new): rename(v, old, new) for k, v in value.items()}
    return value


async def dump(conn: Executor, namespace: str) -> dict[str, Any]:
    """Every key of ``namespace`` (``{namespace}:*``, by SCAN) with its type,
    value and remaining TTL (ms, when it has one)."""
    keys: list[bytes] = []
    cursor = b"0"
    pattern = "{" + namespace + "}:*"
    while True:
        cursor, batch = await conn.execute("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
        keys += batch
        if cursor in (b"0", 0, "0"):
            break
    out: dict[str, Any] = {}
    for raw in sorted(set(keys)):
        key = raw.decode()
        kind = text(await conn.execute("TYPE", raw))
        entry: dict[str, Any] = {"type": kind}
        if kind == "string":
            entry["value"] = text(await conn.execute("GET", raw))
        elif kind == "list":
            entry["value"] = text(await conn.execute("LRANGE", raw, 0, -1))
        elif kind == "set":
            entry["value"] = sorted(text(await conn.execute("SMEMBERS", raw)))
        elif kind == "zset":
            flat = text(await conn.execute("ZRANGE", raw, 0, -1, "WITHSCORES"))
            entry["value"] = [[flat[i], flat[i + 1]] for i in range(0, len(flat), 2)]
        elif kind == "hash":
            flat = text(await conn.execute("HGETALL", raw))
            entry["value"] = dict(sorted(zip(flat[::2], flat[1::2], strict=True)))
        else:
            entry["value"] = None
        pttl = int(await conn.execute("PTTL", raw))
        if pttl >= 0:
            entry["pttl"] = pttl
        out[key] = entry
    return out


async def load(conn: Executor, keyspace: dict[str, Any]) -> None:
    """Write ``keyspace`` (as :func:`dump` gives it; the keys must not exist)."""
    for key, entry in keyspace.items():
        kind, value = entry["type"], entry["value"]
        if kind == "string":
            await conn.execute("SET", key, value)
        elif kind == "list":
            await conn.execute("RPUSH", key, *value)
        elif kind == "set":
            await conn.execute("SADD", key, *value)
        elif kind == "zset":
            flat = [x for member, score in value for x in (score, member)]
            await conn.execute("ZADD", key, *flat)
        elif kind == "hash":
            flat = [x for kv in value.items() for x in kv]
            await conn.execute("HSET", key, *flat)
        else:
            raise ValueError(f"key {key}: unknown type {kind!r}")
        if "pttl" in entry:
            await conn.execute("PEXPIRE", key, max(1, int(entry["pttl"])))


async def clear(conn: Executor, namespace: str) -> None:
    """Delete every key of ``namespace`` (and no other)."""
    for key in await dump_keys(conn, namespace):
        await conn.execute("DEL", key)


async def dump_keys(conn: Executor, namespace: str) -> list[bytes]:
    keys: list[bytes] = []
    cursor = b"0"
    while True:
        cursor, batch = await conn.execute(
            "SCAN", cursor, "MATCH", "{" + namespace + "}:*", "COUNT", 1000
        )
        keys += batch
        if cursor in (b"0", 0, "0"):
            return keys


def source_at(script: str, time: Sequence[int]) -> bytes:
    """The expanded source of ``script`` with the time prelude for ``time``."""
    src = load_scripts()[script].source
    prelude = TIME_PRELUDE % {"s": int(time[0]), "us": int(time[1])}
    return prelude.encode() + src


Caller = Callable[[str, Sequence[int], Sequence[Any], Sequence[Any]], Awaitable[dict[str, Any]]]
"""Runs one script call for a replay: (script name, time, keys, args) to
{"reply": ...} or {"error": message}, and optionally "sha1" (the SHA-1 of
the script as the caller's loader expanded it, without the time prelude)."""


async def call(
    conn: Executor, script: str, time: Sequence[int], keys: Sequence[Any], args: Sequence[Any]
) -> dict[str, Any]:
    """Run ``script`` at ``time``: {"reply": ...} or {"error": message}."""
    try:
        reply = await conn.execute("EVAL", source_at(script, time), len(keys), *keys, *args)
    except CommandError as exc:
        return {"error": error_text(exc)}
    return {"reply": text(reply)}


async def replay(
    conn: Executor, vector: dict[str, Any], namespace: str, caller: Caller | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load the vector's keyspace into ``namespace`` (emptied first), run its
    call (with ``caller``: through a peer's own script loader; else here),
    and return (the outcome, the keyspace after), written in ``ns``."""
    await clear(conn, namespace)
    began = time.monotonic()
    await load(conn, rename(vector["before"], PLACEHOLDER, namespace))
    run: Caller = caller or (lambda *a: call(conn, *a))
    outcome = await run(
        vector["script"],
        vector["time"],
        rename(vector["keys"], PLACEHOLDER, namespace),
        rename(vector["args"], PLACEHOLDER, namespace),
    )
    after = rename(await dump(conn, namespace), namespace, PLACEHOLDER)
    after[ELAPSED] = (time.monotonic() - began) * 1000
    await clear(conn, namespace)
    return rename(outcome, namespace, PLACEHOLDER), after


def compare(vector: dict[str, Any], outcome: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between the recorded vector and a replay (empty: nothing)."""
    diffs = []
    after = dict(after)
    tolerance = TTL_TOLERANCE_MS + after.pop(ELAPSED, 0.0)
    sha = outcome.get("sha1")
    if sha is not None and sha != load_scripts()[vector["script"]].sha:
        diffs.append(
            f"the peer's loader expands {vector['script']}.lua to a script of SHA-1 {sha}; "
            f"the protocol's expansion is {load_scripts()[vector['script']].sha}"
        )
    if "error" in vector:
        if outcome.get("error") != vector["error"]:
            diffs.append(f"expected error {vector['error']!r}, got {_show(outcome)}")
    elif "error" in outcome or not _same_reply(vector, outcome["reply"]):
        diffs.append(f"expected reply {json.dumps(vector['reply'])}, got {_show(outcome)}")
    want = vector["after"]
    for key in sorted(set(want) | set(after)):
        if key not in after:
            diffs.append(f"key {key} missing after the call (expected {json.dumps(want[key])})")
        elif key not in want:
            diffs.append(f"key {key} should not exist after the call: {json.dumps(after[key])}")
        else:
            a, b = want[key], after[key]
            if a["type"] != b["type"] or not same_value(a["value"], b["value"]):
                diffs.append(f"key {key}: expected {json.dumps(a)}, got {json.dumps(b)}")
            elif ("pttl" in a) != ("pttl" in b) or (
                "pttl" in a and abs(a["pttl"] - b["pttl"]) > tolerance
            ):
                diffs.append(
                    f"key {key}: expected a TTL of {a.get('pttl', 'none')} ms, "
                    f"got {b.get('pttl', 'none')}"
                )
    return diffs


def _same_reply(vector: dict[str, Any], reply: Any) -> bool:
    want = vector["reply"]
    if vector.get("unordered") and isinstance(want, list) and isinstance(reply, list):
        # {code, name...}: the names come from a set, in no particular order
        return bool(
            want[:1] == reply[:1] and sorted(map(str, want[1:])) == sorted(map(str, reply[1:]))
        )
    return same_value(want, reply)


def same_value(want: Any, got: Any) -> bool:
    """Whether a recorded value and a replayed one say the same to a peer:
    equal, where a string that holds a JSON object (a queue's policy, from
    ``cjson.encode``, whose key order differs between servers) is compared
    by what it decodes to. Lists and hashes (dicts) are compared entry by
    entry the same way."""
    if isinstance(want, list) and isinstance(got, list):
        return len(want) == len(got) and all(map(same_value, want, got))
    if isinstance(want, dict) and isinstance(got, dict):
        return want.keys() == got.keys() and all(same_value(want[k], got[k]) for k in want)
    if isinstance(want, str) and isinstance(got, str) and want != got:
        a, b = _json_object(want), _json_object(got)
        return a is not None and a == b
    return bool(want == got)


def _json_object(value: str) -> dict[str, Any] | None:
    if not value.startswith("{"):
        return None
    try:
        decoded = json.loads(value)
    except ValueError:
        return None
    return decoded if isinstance(decoded, dict) else None


def _show(outcome: dict[str, Any]) -> str:
    if "error" in outcome:
        return f"error {outcome['error']!r}"
    return f"reply {json.dumps(outcome['reply'])}"


def load_vectors(directory: Path) -> list[tuple[str, dict[str, Any]]]:
    """(file name, vector) for every vector of ``directory``, in order."""
    out = []
    for path in sorted(directory.glob("*.json")):
        for v in json.loads(path.read_text())["vectors"]:
            out.append((path.name, v))
    return out


async def check_vectors(
    conn: Executor,
    vectors: Sequence[tuple[str, dict[str, Any]]],
    namespace: str,
    log: Callable[[str], None] = lambda _: None,
    caller: Caller | None = None,
) -> list[Mismatch]:
    """Replay every vector in ``namespace`` (each call through ``caller``: a
    peer's own script loader; default: here); the mismatches, one per vector
    that differs (all its differences in ``what``)."""
    bad = []
    for file, v in vectors:
        outcome, after = await replay(conn, v, namespace, caller)
        diffs = compare(v, outcome, after)
        if diffs:
            bad.append(Mismatch(file, v["name"], "; ".join(diffs)))
    log(f"vectors: {len(vectors) - len(bad)} of {len(vectors)} match")
    return bad
