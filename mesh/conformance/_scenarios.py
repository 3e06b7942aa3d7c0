"""Run the conformance scenarios (``protocol/conformance/scenarios/*.json``)
against a peer under test, through the line protocol.

The harness starts each peer of a scenario as a process (the command given,
or the Python peer), timestamps every line it reads with its own monotonic
clock, drives the peers step by step, and checks the invariants over the
whole record (see protocol/conformance/README.md, "Scenarios"). A failed step
or invariant becomes a :class:`Failure` naming the scenario, the invariant and
the evidence; the harness never raises for a misbehaving peer.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from mesh._connection import Connection

from . import _invariants
from ._record import FENCE_GRACE as FENCE_GRACE
from ._record import OVERLAP_JITTER as OVERLAP_JITTER
from ._record import PYTHON_PEER as PYTHON_PEER
from ._record import REPLY_TIMEOUT as REPLY_TIMEOUT
from ._record import START_TIMEOUT as START_TIMEOUT
from ._record import Failure as Failure
from ._record import Interval as Interval
from ._record import PeerProc as PeerProc
from ._record import ScenarioFailed
from ._steps import Steps


def load_scenarios(directory: Path) -> list[dict[str, Any]]:
    """The scenarios of ``directory``, in file-name order."""
    out = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        data.setdefault("name", path.stem)
        out.append(data)
    return out


class Run(Steps):
    """One scenario's run against one Redis: its peers launched, its steps
    done in order, then the invariants checked over the whole record."""

    async def run(self) -> list[Failure]:
        try:
            async with anyio.create_task_group() as nursery:
                try:
                    # Every process is launched at once (each waits for its
                    # start command): their start-up overlaps the steps.
                    for peer in self.peers.values():
                        await self.launch(nursery, peer)
                    for i, step in enumerate(self.sc["steps"]):
                        began = self.now()
                        try:
                            await self.step(nursery, step)
                            self.log_step(i, step, self.now() - began)
                        except ScenarioFailed as exc:
                            what = step.get("invariant", step.get("do", "step"))
                            hint = f" ({step['hint']})" if "hint" in step else ""
                            self.fail(str(what), f"step {i + 1} ({json.dumps(step)}): {exc}{hint}")
                            break
                finally:
                    await self.finish(nursery)
        finally:
            for peer in self.peers.values():
                if peer.stderr is not None:
                    peer.stderr.close()
        self.check()
        return self.failures

    def log_step(self, i: int, step: dict[str, Any], took: float) -> None:
        if os.environ.get("MESH_CONFORMANCE_STEPS"):
            self.log(f"  step {i + 1} {step['do']} {step.get('peer', '')}: {took:.2f} s")

    def check(self) -> None:
        """Check the invariants over the whole record (see :mod:`._invariants`)."""
        _invariants.check(self)


async def run_scenarios(
    scenarios: Sequence[dict[str, Any]],
    url: str,
    conn: Connection,
    peer_command: str,
    prefix: str,
    log: Callable[[str], None],
) -> list[Failure]:
    """Run each scenario in a namespace of its own (``prefix`` + its name)."""
    failures: list[Failure] = []
    for sc in scenarios:
        namespace = f"{prefix}-{sc['name']}"[:64]
        run = Run(sc, url, conn, peer_command, namespace, log)
        run.t0 = anyio.current_time()
        log(f"scenario {sc['name']} ...")
        got = await run.run()
        took = anyio.current_time() - run.t0
        log(f"scenario {sc['name']}: {'ok' if not got else 'FAILED'} ({took:.1f} s)")
        failures += got
    return failures


def new_prefix() -> str:
    """A fresh namespace prefix for one run of the suite."""
    return f"conformance-{secrets.token_hex(4)}"
