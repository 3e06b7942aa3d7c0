"""What every part of the :class:`~mesh.Client` shares: its connection, key
names, script binding and reader, the closed check and the payload check.
The parts (writes, admin, reads, results) each add a group of methods;
:mod:`mesh._client` composes them into :class:`~mesh.Client`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from ._binding import Binding, payload_bytes
from ._blob import BLOB_MIN, check_payload, standins, stored
from ._connection import Connection
from ._errors import ConflictError
from ._keys import Keys
from ._reads import Reader

__all__ = ["DEFAULT_MAX_PAYLOAD", "ClientCore"]

T = TypeVar("T")

DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024


class ClientCore:
    """The state a client's parts share (set by :class:`~mesh.Client`'s
    constructor), and the checks each call starts with."""

    _conn: Connection
    _keys: Keys
    _binding: Binding
    _reads: Reader
    _max_payload: int
    _min_replicas: int

    def _check(self) -> Connection:
        return self._reads.check()

    def _payloads(self, tasks: Iterable[object], *, named: bool = False) -> list[bytes]:
        """The payloads ``tasks``; ``named``: as the calls that name tasks
        take them (a stand-in a read gave names its big payload: see
        :func:`mesh._blob.stored`), else as the calls that add them."""
        if isinstance(tasks, str | bytes | bytearray | memoryview):
            raise TypeError("tasks must be an iterable of payloads, not a single payload")
        limit = self._max_payload
        if named:
            return [stored(payload_bytes(t, limit, named=True)) for t in tasks]
        # bytes as they are, the others converted; then the limit and the
        # mark of a stand-in tested once for all of them, in C (a Python call
        # per payload cost a producer of small payloads a fifth of its
        # enqueue rate): only a payload that is empty or starts with a NUL
        # byte can be the smallest and start with the mark
        out = [t if type(t) is bytes else payload_bytes(t, named=True) for t in tasks]
        if out:
            if limit is not None and max(map(len, out)) > limit:
                for p in out:
                    payload_bytes(p, limit)  # raises, naming the size
            low = min(out)
            if not low or low[0] == 0:
                for p in out:
                    check_payload(p)
        return out

    async def _replicated(self, conn: Connection) -> None:
        """With ``min_replicas``, return only once that many replicas have the
        writes made so far (``WAIT``, bounded by the URL's connect_timeout);
        MeshConnectionError otherwise."""
        if self._min_replicas:
            await conn.wait_replicas(self._min_replicas, conn.config.connect_timeout)

    async def _with_blobs(
        self,
        conn: Connection,
        payloads: list[bytes],
        call: Callable[[list[bytes]], Awaitable[T]],
    ) -> T:
        """``call`` with what the queue holds for ``payloads``: the big ones
        (over :data:`~mesh._blob.BLOB_MIN`) are uploaded first and passed as
        stand-ins (see :mod:`mesh._blob`). An upload that expired before the
        call (the call's CONFLICT says so) is made again, once.

        Raises:
            What ``call`` and the upload raise; on cancellation an upload
            already made expires within an hour.
        """
        if max(map(len, payloads), default=0) <= BLOB_MIN:  # (in C: no call per payload)
            return await call(payloads)
        stored = standins(payloads)
        for again in (False, True):
            await self._binding.put_blobs(conn, payloads)
            try:
                return await call(stored)
            except ConflictError as exc:
                if again or "blob is gone" not in str(exc):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover
