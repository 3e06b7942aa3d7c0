"""Run the whole conformance suite: the script vectors, then the scenarios."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import anyio
import attrs

from mesh._connection import open_connection
from mesh._url import RedisConfig

from . import _linepeer, _scenarios, _vectors


def suite_dir() -> Path:
    """protocol/conformance/ of this installation."""
    try:
        d = Path(str(resources.files("mesh.protocol"))) / "conformance"
        if d.is_dir():
            return d
    except ModuleNotFoundError:  # pragma: no cover (a checkout used without installing)
        pass
    return Path(__file__).resolve().parent.parent.parent / "protocol" / "conformance"


@attrs.define
class Report:
    vectors: int = 0
    scenarios: int = 0
    mismatches: list[_vectors.Mismatch] = attrs.Factory(list)
    failures: list[_scenarios.Failure] = attrs.Factory(list)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.failures

    def lines(self) -> list[str]:
        out = []
        for m in self.mismatches:
            out.append(f"FAIL vector {m.file} {m.vector}: {m.what}")
        for f in self.failures:
            out.append(f"FAIL scenario {f.scenario}: {f.invariant}: {f.evidence}")
        bad = len(self.mismatches) + len({f.scenario for f in self.failures})
        out.append(
            f"conformance: {self.vectors} vectors, {self.scenarios} scenarios: "
            + ("all passed" if self.ok else f"{bad} failed")
        )
        return out


async def run_suite(
    url: str,
    config: RedisConfig,
    peer: str | None,
    *,
    only: Sequence[str] = (),
    log: Callable[[str], None] = lambda _: None,
) -> Report:
    """Run the vectors and the scenarios (``only``: the scenario names to run,
    ``vectors`` for the vectors; empty: everything) against the Redis at
    ``url``, each in a namespace of its own under a fresh random prefix, whose
    keys are deleted afterwards. No other key is read or written (the
    harness also runs ``CLIENT LIST``, and ``CLIENT KILL ID`` on connections
    of its own peer processes)."""
    d = suite_dir()
    prefix = _scenarios.new_prefix()
    report = Report()
    used = [f"{prefix}-vectors"]
    async with open_connection(config, name="mesh-conformance") as conn:
        try:
            if not only or "vectors" in only:
                vectors = _vectors.load_vectors(d / "vectors")
                report.vectors = len(vectors)
                report.mismatches = await check_vectors_through(
                    conn, url, peer or _scenarios.PYTHON_PEER, vectors, used[0], log
                )
            scenarios = [
                s
                for s in _scenarios.load_scenarios(d / "scenarios")
                if not only or s["name"] in only
            ]
            report.scenarios = len(scenarios)
            used += [f"{prefix}-{s['name']}"[:64] for s in scenarios]
            report.failures = await _scenarios.run_scenarios(
                scenarios, url, conn, peer or _scenarios.PYTHON_PEER, prefix, log
            )
        finally:
            with anyio.CancelScope(shield=True):
                for ns in used:
                    await _vectors.clear(conn, ns)
    return report


async def check_vectors_through(
    conn: _vectors.Executor,
    url: str,
    peer: str,
    vectors: Sequence[tuple[str, dict[str, Any]]],
    namespace: str,
    log: Callable[[str], None] = lambda _: None,
) -> list[_vectors.Mismatch]:
    """Replay the vectors with each call run by the peer process ``peer``
    (its own loader and client: the line protocol's ``script`` command); the
    harness writes and reads the keyspace. A peer that refuses the command or
    breaks off is one mismatch naming the vector it stopped at."""
    async with _linepeer.open_script_peer(peer, url, namespace) as caller:
        done: list[str] = []

        async def counted(*a: Any) -> dict[str, Any]:
            out = await caller(*a)
            done.append(a[0])
            return out

        try:
            return await _vectors.check_vectors(conn, vectors, namespace, log, counted)
        except _linepeer.PeerRefused as exc:
            file, v = vectors[len(done)]
            return [_vectors.Mismatch(file, v["name"], f"run through the peer: {exc}")]


def scenario_names() -> list[str]:
    return [s["name"] for s in _scenarios.load_scenarios(suite_dir() / "scenarios")]
