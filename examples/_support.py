"""Helpers shared by the examples: where Redis is, a narrator that stamps each
line with the time since start, and polling with a deadline.

Not part of trio-mesh; copy what you need.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import trio

__all__ = ["Narrator", "redis_url", "wait_until"]


@contextmanager
def redis_url(say: Callable[[str], None] = print) -> Iterator[str]:
    """The Redis URL to use: ``$MESH_REDIS_URL`` if set, else a throwaway
    redis-server started for the duration of the ``with`` block (on a free
    port of 127.0.0.1, nothing kept on disk).

    Raises:
        mesh.ConfigError: no URL is set and no redis-server binary was found.
    """
    url = os.environ.get("MESH_REDIS_URL")
    if url:
        yield url
        return
    from mesh.testing import run_redis_server  # a test helper of trio-mesh

    with run_redis_server() as server:
        say(f"($MESH_REDIS_URL is not set: started a throwaway redis-server at {server.url})")
        yield server.url


class Narrator:
    """Print lines prefixed with the seconds since the narrator was made.

    Call it from inside ``trio.run`` (it reads trio's clock).
    """

    def __init__(self, out: Callable[[str], None] | None = None) -> None:
        self._out = out or _print_flush
        self._t0 = trio.current_time()

    def elapsed(self) -> float:
        """Seconds since the narrator was made."""
        return trio.current_time() - self._t0

    def __call__(self, text: str) -> None:
        self._out(f"[{self.elapsed():6.2f}] {text}")


def _print_flush(text: str) -> None:
    print(text, flush=True)
    sys.stdout.flush()


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], *, within: float, what: str, every: float = 0.02
) -> None:
    """Poll ``predicate`` until it returns True.

    Used for state that lives in Redis or in another process, which no event
    announces to us.

    Raises:
        TimeoutError: it was still False after ``within`` seconds.
    """
    with trio.move_on_after(within):
        while not await predicate():  # noqa: ASYNC110 - a poll with a deadline
            await trio.sleep(every)
        return
    raise TimeoutError(f"gave up after {within:g} s waiting for {what}")
