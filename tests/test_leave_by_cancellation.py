"""Leaving a block by a cancellation from outside still cleans up promptly:
the connection serves the block's shielded clean-up, so a worker cancelled
from outside hands its processes back at once (not after its TTL)."""

from __future__ import annotations

import trio

import mesh
from mesh._connection import open_connection

from .test_worker import wait_for


async def test_a_cancelled_connection_block_can_still_talk_in_shielded_cleanup(
    redis_url: str, namespace: str
) -> None:
    key = f"{namespace}-k"
    with trio.CancelScope() as outer:
        async with open_connection(redis_url) as conn:
            try:
                outer.cancel()
                await trio.sleep_forever()
            finally:
                with trio.move_on_after(2) as cs:
                    cs.shield = True
                    await conn.execute("SET", key, "cleaned up")
    assert outer.cancelled_caught
    async with open_connection(redis_url) as conn:
        assert await conn.execute("GET", key) == b"cleaned up"


async def test_a_worker_cancelled_from_outside_hands_back_at_once(
    redis_url: str, namespace: str
) -> None:
    ttl = 3.0

    async def handler(p: mesh.Process) -> None:
        await trio.sleep_forever()

    async with mesh.open_client(redis_url, namespace=namespace) as client:
        with trio.CancelScope() as outer:
            async with mesh.open_worker(redis_url, namespace=namespace, ttl=ttl) as w:
                await w.start_work("devices", handler)
                await client.ensure("devices", "d1")

                async def running() -> bool:
                    return len(await client.processes("devices")) == 1

                await wait_for(running)
                t0 = trio.current_time()
                outer.cancel()
                await trio.sleep_forever()
        took = trio.current_time() - t0
        info = await client.queue_info("devices")
        assert (info.queued, info.running) == (1, 0)
        assert await client.workers() == []
        assert took < ttl / 3, f"leaving took {took:.3f} s"
