"""What a pub/sub connection is subscribed to, without I/O.

:class:`Subscriptions` keeps two sets of each kind (channels, patterns, sharded
channels): what the caller asked for, and what Redis confirmed on the current
socket. :class:`~mesh._pubsub.PubSub` feeds it the server's confirmations
(:meth:`Subscriptions.confirm`), asks it for the commands to send (on a new socket,
every subscription at once: :meth:`Subscriptions.resubscribe`) and whether a
request is done; the socket, the trio tasks and the waiting stay there.

Errors: none raised here but ConfigError (a name of the wrong type, from
:func:`names`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import attrs

from ._errors import CommandError, ConfigError
from ._transport import pack

__all__ = ["Message", "Subscriptions", "names"]


@attrs.frozen
class Message:
    """One event from a :class:`~mesh._pubsub.PubSub`.

    Attributes:
        kind: ``"message"`` (from a channel subscription), ``"smessage"`` (from a
            sharded channel subscription: an ``SPUBLISH``), ``"pmessage"`` (from a
            pattern subscription) or ``"reconnected"`` (the connection was re-made
            and every subscription restored; messages may have been missed).
        channel: the channel it was published on (``b""`` for ``reconnected``).
        data: the payload, byte for byte (``b""`` for ``reconnected``).
        pattern: the matching pattern, for ``pmessage`` only.
    """

    kind: Literal["message", "smessage", "pmessage", "reconnected"]
    channel: bytes
    data: bytes
    pattern: bytes | None = None


def names(given: Iterable[bytes | str], what: str) -> list[bytes]:
    """Channel or pattern names as bytes (``str`` encoded as UTF-8).

    Raises:
        ConfigError: a name that is neither bytes nor str.
    """
    out: list[bytes] = []
    for name in given:
        if isinstance(name, str):
            out.append(name.encode())
        elif isinstance(name, bytes):
            out.append(name)
        else:
            raise ConfigError(f"a {what} must be bytes or str, not {type(name).__name__}")
    return out


class Subscriptions:
    """The channels and patterns asked for, and those confirmed on this socket."""

    def __init__(self) -> None:
        self.channels: set[bytes] = set()  # what the caller asked for
        self.patterns: set[bytes] = set()
        self.sharded: set[bytes] = set()  # of self.channels, also wanted sharded
        self.confirmed_channels: set[bytes] = set()  # what Redis confirmed on this socket
        self.confirmed_patterns: set[bytes] = set()
        self.confirmed_sharded: set[bytes] = set()
        # Whether this socket takes SSUBSCRIBE: unknown until refused (6.2, ACL).
        self.shard_ok = True

    def commands(self, command: bytes, sharded: bytes | None, names: list[bytes]) -> bytes:
        """``command names``, and ``sharded names`` if this socket takes it."""
        data = b"".join(pack((command, *names)))
        if sharded is not None and self.shard_ok:
            data += b"".join(pack((sharded, *names)))
        return data

    def subscribed(self, names: list[bytes], sharded: bool) -> bool:
        """Whether every one of ``names`` is confirmed (both ways if ``sharded``
        and this socket takes SSUBSCRIBE)."""
        return self.confirmed_channels.issuperset(names) and (
            not sharded or not self.shard_ok or self.confirmed_sharded.issuperset(names)
        )

    def unsubscribed(self, names: list[bytes]) -> bool:
        """Whether none of the channels ``names`` is confirmed any more, either way."""
        return self.confirmed_channels.isdisjoint(names) and self.confirmed_sharded.isdisjoint(
            names
        )

    def lost(self) -> None:
        """The socket broke or is new: nothing is confirmed on it."""
        self.confirmed_channels.clear()
        self.confirmed_patterns.clear()
        self.confirmed_sharded.clear()

    def resubscribe(self) -> tuple[bytes, set[bytes], set[bytes], set[bytes]]:
        """For a new socket (which may take SSUBSCRIBE again): the commands that
        subscribe everything asked for, and the channels, patterns and sharded
        channels they subscribe (see :meth:`restored`)."""
        channels, patterns = set(self.channels), set(self.patterns)
        sharded = self.sharded & channels
        self.shard_ok = True
        data = b""
        if channels:
            data += b"".join(pack((b"SUBSCRIBE", *sorted(channels))))
        if sharded:
            data += b"".join(pack((b"SSUBSCRIBE", *sorted(sharded))))
        if patterns:
            data += b"".join(pack((b"PSUBSCRIBE", *sorted(patterns))))
        return data, channels, patterns, sharded

    def restored(self, channels: set[bytes], patterns: set[bytes], sharded: set[bytes]) -> bool:
        """Whether what :meth:`resubscribe` sent is all confirmed."""
        return (
            self.confirmed_channels.issuperset(channels)
            and self.confirmed_patterns.issuperset(patterns)
            and (not self.shard_ok or self.confirmed_sharded.issuperset(sharded))
        )

    def confirm(self, kind: bytes, name: object) -> bool:
        """Record the server's confirmation ``kind`` (``subscribe``, ``sunsubscribe``...)
        for ``name``. Returns True for an ``sunsubscribe`` nobody asked for: the node
        no longer serves a sharded channel's slot (a migration or failover)."""
        if not isinstance(name, bytes):
            return False
        if kind == b"ssubscribe":
            self.confirmed_sharded.add(name)
        elif kind == b"sunsubscribe":
            self.confirmed_sharded.discard(name)
            return name in self.sharded
        else:
            target = self.confirmed_patterns if kind.startswith(b"p") else self.confirmed_channels
            if kind.endswith(b"unsubscribe"):
                target.discard(name)
            else:
                target.add(name)
        return False

    def shard_refused(self, reply: CommandError) -> bool:
        """Whether ``reply`` is an SSUBSCRIBE refused (unknown before 7.0, or the
        ACL): then this socket stays on SUBSCRIBE."""
        text = str(reply).lower()
        if "ssubscribe" not in text or reply.code not in ("ERR", "NOPERM"):
            return False
        self.shard_ok = False
        self.confirmed_sharded.clear()
        return True
