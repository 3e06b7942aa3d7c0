"""A queue's groups, as the :class:`~mesh.Client` sets and reads them: each
group's settings (concurrency across the mesh, rate limit, weight) and the
queue's default for every group, pausing and resuming one group, and what
each group holds. Putting jobs into a group is :meth:`~mesh.Client.enqueue`'s
``group``; the claim that picks among the groups is
``protocol/include/group.lua``.
"""

from __future__ import annotations

from ._client_core import ClientCore
from ._errors import CommandError, ConfigError
from ._group_reads import GroupSettings, GroupsLook, parse_group_settings, read_groups
from ._keys import check_group, check_queue
from ._validate import whole

__all__ = ["ClientGroups", "group_fields"]

#: The most a group's weight may be.
MAX_WEIGHT = 1000


def group_fields(
    concurrency: int | None,
    rate_limit: int | tuple[int, float] | None,
    weight: int | None,
) -> list[str]:
    """configure_group.lua's four fields ("" for a setting not given).

    Raises:
        ConfigError: a value out of range.
    """
    fields = ["", "", "", ""]
    if concurrency is not None:
        fields[0] = str(whole("concurrency", concurrency))
    if rate_limit is not None:
        n, per = rate_limit if isinstance(rate_limit, tuple) else (rate_limit, 1.0)
        fields[1] = str(whole("rate_limit", n))
        if not isinstance(per, int | float) or isinstance(per, bool) or not 0.001 <= per <= 86400:
            raise ConfigError(f"rate_limit period must be 0.001 to 86400 seconds, not {per!r}")
        fields[2] = str(round(per * 1000))
    if weight is not None:
        fields[3] = str(whole("weight", weight, 1, MAX_WEIGHT))
    return fields


class ClientGroups(ClientCore):
    """Groups of a queue (part of :class:`~mesh.Client`)."""

    async def configure_group(
        self,
        queue: str,
        group: str,
        *,
        concurrency: int | None = None,
        rate_limit: int | tuple[int, float] | None = None,
        weight: int | None = None,
    ) -> GroupSettings:
        """Set the settings of ``group`` of ``queue``; those not given (None)
        keep their stored value, or the queue's default for every group
        (:meth:`configure`'s ``group_concurrency``, ...). They hold across
        the whole mesh from the next claim on.

        Args:
            concurrency: at most this many of the group's jobs run at once on
                all workers together (a retry waiting for its backoff holds
                its place, so 1 keeps the group's jobs in strict order).
                0: no cap (the default).
            rate_limit: at most N of the group's jobs start per second
                (``N``), or per ``seconds`` (``(N, seconds)``). 0: no limit.
            weight: the group's share of the claims while other groups have
                jobs ready, 1 to 1000 (default 1): a group of weight 3 starts
                three jobs for each one of a group of weight 1.

        Returns:
            The group's own settings now (None for those it takes from the
            queue's default).
        Raises:
            ConfigError: a bad queue or group name or a value out of range
                (nothing was written).
        """
        check_group(group)
        return await self._configure_group(queue, group, concurrency, rate_limit, weight)

    async def clear_group(self, queue: str, group: str) -> None:
        """Remove the own settings of ``group``: it follows the queue's
        default again.

        Raises:
            ConfigError: a bad queue or group name.
        """
        conn = self._check()
        check_queue(queue)
        check_group(group)
        await self._binding.configure_group(conn, queue, group, "clear", [])

    async def _configure_group(
        self,
        queue: str,
        group: str,
        concurrency: int | None,
        rate_limit: int | tuple[int, float] | None,
        weight: int | None,
    ) -> GroupSettings:
        conn = self._check()
        check_queue(queue)
        fields = group_fields(concurrency, rate_limit, weight)
        try:
            raw = await self._binding.configure_group(conn, queue, group, "set", fields)
        except CommandError as exc:
            if exc.code == "BAD_ARG":
                raise ConfigError(str(exc).removeprefix("BAD_ARG ")) from None
            raise
        await self._replicated(conn)
        return parse_group_settings(raw)

    async def pause_group(self, queue: str, group: str) -> bool:
        """Pause ``group``: no worker starts a job of it until
        :meth:`resume_group`; its running jobs go on, enqueues and delayed
        jobs still add to it, and the queue's other groups run on.

        Returns:
            True if it was not paused already.
        Raises:
            ConfigError: a bad queue or group name.
        """
        return await self._pause_group(queue, group, "pause")

    async def resume_group(self, queue: str, group: str) -> bool:
        """Resume ``group`` (see :meth:`pause_group`) and wake the queue's
        idle workers for its jobs.

        Returns:
            True if it was paused.
        """
        return await self._pause_group(queue, group, "resume")

    async def _pause_group(self, queue: str, group: str, mode: str) -> bool:
        conn = self._check()
        check_queue(queue)
        check_group(group)
        changed = await self._binding.pause_group(conn, queue, group, mode)
        await self._replicated(conn)
        return changed

    async def groups(self, queue: str, *, limit: int = 100) -> GroupsLook:
        """A look at the groups of ``queue`` that hold anything (jobs queued,
        running or delayed), are paused or have settings of their own: the
        ``limit`` with the most jobs queued (most first), how many there are,
        and the queue's default settings for every group.

        Raises:
            ConfigError: a bad queue name or limit.
        """
        conn = self._check()
        check_queue(queue)
        whole("limit", limit, 1)
        return await read_groups(conn, self._keys, queue, limit)
