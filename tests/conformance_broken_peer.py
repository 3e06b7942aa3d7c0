"""A deliberately wrong peer of the conformance line protocol, to show that
the harness catches one (tests/test_conformance.py). It is the Python peer
with one fault, named by its first argument:

- ``no-handback``: ``stop`` writes ``stopped`` and exits at once, without
  stopping its handlers or handing their tasks back (peers get them only
  when its lease runs out).
- ``same-token``: every ``start`` event names token 1, as a peer that keeps
  one fencing token would.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import anyio.abc
import trio

from mesh.conformance import peer as reference


class BrokenPeer(reference.Peer):
    def __init__(self, url: str, namespace: str, fault: str) -> None:
        super().__init__(url, namespace)
        self.fault = fault

    def emit(self, **event: Any) -> None:
        if self.fault == "same-token" and event.get("event") in ("start", "stop", "done"):
            event["token"] = 1
        super().emit(**event)

    async def _command(self, line: bytes, nursery: anyio.abc.TaskGroup) -> bool:
        if self.fault == "no-handback" and b'"stop"' in line:
            self.emit(event="stopped")
            os._exit(0)
        return await super()._command(line, nursery)


def main() -> int:
    fault = sys.argv[1]
    if fault not in ("no-handback", "same-token"):
        print(f"unknown fault {fault!r}", file=sys.stderr)
        return 2
    peer = BrokenPeer(os.environ["MESH_REDIS_URL"], os.environ["MESH_NAMESPACE"], fault)
    trio.run(peer.run)
    return peer.exit_code


if __name__ == "__main__":
    sys.exit(main())
