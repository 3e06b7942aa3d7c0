"""Background trio tasks that outlive a cancellation of the block that owns them.

A connection's reader and writer, a pub/sub connection, a worker's lease,
runners and heartbeat, and a fleet's renewals run as trio tasks beside the
user's ``async with`` block. When that block is cancelled from outside (the
trio way to stop a service), the block's shielded clean-up still needs them: a
worker keeps renewing its lease while its handlers exit and hands each process
back after its handler exited (invariant 10). So these tasks run in cancel
scopes shielded from the caller's cancellations, and are cancelled only by
:meth:`ShieldedTasks.cancel`, which the block calls when it is left (in a
``finally``, so that an error on the way cannot leave them running and hang
the nursery).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc


class ShieldedTasks:
    """Starts tasks in ``nursery``, each in its own cancel scope shielded from
    the caller's cancellations; :meth:`cancel` cancels them all."""

    def __init__(self, nursery: anyio.abc.TaskGroup) -> None:
        self._nursery = nursery
        self._scopes: list[anyio.CancelScope] = []
        self._cancelled = False

    def _scope(self) -> anyio.CancelScope:
        scope = anyio.CancelScope(shield=True)
        if self._cancelled:
            scope.cancel()
        self._scopes.append(scope)
        return scope

    def start_soon(self, fn: Callable[[], Awaitable[Any]]) -> None:
        """``nursery.start_soon(fn)``, shielded."""
        scope = self._scope()

        async def run() -> None:
            with scope:
                await fn()

        self._nursery.start_soon(run, name=getattr(fn, "__qualname__", None))

    async def start(self, fn: Callable[..., Awaitable[Any]]) -> None:
        """``await nursery.start(fn)``, shielded: returns once ``fn`` called
        ``task_status.started()``; raises what ``fn`` raised before that."""
        scope = self._scope()

        async def run(task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await fn(task_status=task_status)

        await self._nursery.start(run, name=getattr(fn, "__qualname__", None))

    def cancel(self) -> None:
        """Cancel every task started here (and any started later)."""
        self._cancelled = True
        for scope in self._scopes:
            scope.cancel()
