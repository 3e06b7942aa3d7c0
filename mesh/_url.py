"""Redis URLs: parse ``redis://``, ``rediss://`` and ``unix://`` into a :class:`RedisConfig`.

Accepted forms::

    redis://[[user]:password@]host[:port][/db][?connect_timeout=SECONDS]
    rediss://[[user]:password@]host[:port][/db][?ssl_cert_reqs=none|required][&ssl_ca_certs=PATH]
    unix://[[user]:password@]/path/to/redis.sock[?db=N][&connect_timeout=SECONDS]

User and password are percent-decoded. When the URL has no password,
``$MESH_REDIS_PASSWORD`` (and, if the URL has no user, ``$MESH_REDIS_USERNAME``)
are used, so that secrets can stay out of command lines.

No error message and no ``repr`` ever contains the password.
"""

from __future__ import annotations

import math
import os
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import attrs

from ._errors import ConfigError

__all__ = ["RedisConfig", "parse_url"]

_SCHEMES = ("redis", "rediss", "unix")
_QUERY_KEYS = frozenset({"db", "connect_timeout", "ssl_cert_reqs", "ssl_ca_certs"})


@attrs.frozen
class RedisConfig:
    """Where and how to connect to Redis. Build one with :func:`parse_url` or directly.

    ``path`` set means a unix socket (``host`` and ``port`` are then unused).
    ``password`` is left out of ``repr``; use :meth:`redacted` in logs and messages.
    """

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    tls: bool = False
    tls_verify: bool = True
    tls_ca_file: str | None = None
    connect_timeout: float = 5.0

    def redacted(self) -> str:
        """A URL for this config that is safe to log: the password is shown as ``***``.

        Returns:
            For example ``redis://alice:***@[::1]:6380/2`` or ``unix:///run/redis.sock?db=1``.
        """
        userinfo = ""
        if self.username is not None or self.password is not None:
            user = quote(self.username, safe="") if self.username else ""
            userinfo = user + (":***" if self.password is not None else "") + "@"
        if self.path is not None:
            query = f"?db={self.db}" if self.db else ""
            return f"unix://{userinfo}{quote(self.path)}{query}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{userinfo}{host}:{self.port}/{self.db}"


def _scrub(url: str) -> str:
    """``url`` with its whole userinfo (user and password) replaced by ``***``.

    Used in parse errors: a malformed URL may have a password where a user name
    belongs (``redis://secret@host``), so neither part is shown.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        # No authority part we can find: show only the scheme-ish prefix, never the rest,
        # since we cannot tell where a password would be.
        return "<unparseable URL>"
    end = len(rest)
    for ch in "/?#":
        i = rest.find(ch)
        if i != -1:
            end = min(end, i)
    netloc, tail = rest[:end], rest[end:]
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return f"{scheme}://{netloc}{tail}"


def parse_url(url: str) -> RedisConfig:
    """Parse a Redis URL.

    Args:
        url: a ``redis://``, ``rediss://`` or ``unix://`` URL (see the module docstring).
            Surrounding whitespace is ignored.

    Returns:
        The parsed configuration.

    Raises:
        ConfigError: the URL is malformed; the message names the part that is wrong
            (scheme, port, db, query parameter...) and never contains the password.
    """
    if not isinstance(url, str):
        raise ConfigError(f"a Redis URL must be a str, not {type(url).__name__}")
    url = url.strip()
    shown = _scrub(url)
    password: str | None = None

    def fail(what: str) -> ConfigError:
        msg = f"bad Redis URL {shown}: {what}"
        if password:
            msg = msg.replace(password, "***")
        return ConfigError(msg)

    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unbalanced '[' in an IPv6 host
        raise fail(f"cannot parse it ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise fail(
            f"unsupported scheme {scheme + '://' if scheme else '(none)'}; "
            "use redis://, rediss:// or unix://"
        )
    if parts.fragment:
        raise fail("unexpected #fragment")

    # -- credentials
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if not at:
        userinfo, hostport = "", netloc
    username: str | None = None
    if userinfo:
        user_raw, colon, pass_raw = userinfo.partition(":")
        username = unquote(user_raw) or None
        password = unquote(pass_raw) if colon and pass_raw else None
    if password is None:
        password = os.environ.get("MESH_REDIS_PASSWORD") or None
        if password is not None and username is None:
            username = os.environ.get("MESH_REDIS_USERNAME") or None
    if username is not None and password is None:
        raise fail(
            "it has a user name but no password (and $MESH_REDIS_PASSWORD is not set); "
            "for a password alone write redis://:PASSWORD@host"
        )

    # -- query
    query: dict[str, str] = {}
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False)
    except ValueError as exc:
        raise fail(f"bad query string ({exc})") from None
    for key, value in pairs:
        if key not in _QUERY_KEYS:
            raise fail(f"unknown query parameter {key!r} (known: {', '.join(sorted(_QUERY_KEYS))})")
        if key in query:
            raise fail(f"query parameter {key!r} given twice")
        query[key] = value

    connect_timeout = 5.0
    if "connect_timeout" in query:
        try:
            connect_timeout = float(query["connect_timeout"])
        except ValueError:
            connect_timeout = math.nan
        if not (connect_timeout > 0 and math.isfinite(connect_timeout)):
            raise fail(
                f"connect_timeout must be a positive number of seconds, "
                f"not {query['connect_timeout']!r}"
            )

    tls = scheme == "rediss"
    tls_verify = True
    tls_ca_file: str | None = None
    if not tls and ("ssl_cert_reqs" in query or "ssl_ca_certs" in query):
        raise fail("ssl_cert_reqs and ssl_ca_certs are only valid with rediss://")
    if "ssl_cert_reqs" in query:
        reqs = query["ssl_cert_reqs"].lower()
        if reqs == "none":
            tls_verify = False
        elif reqs not in ("required", "optional"):
            raise fail(
                f"ssl_cert_reqs must be none, optional or required, not {query['ssl_cert_reqs']!r}"
            )
    if "ssl_ca_certs" in query:
        if not query["ssl_ca_certs"]:
            raise fail("ssl_ca_certs is empty")
        tls_ca_file = query["ssl_ca_certs"]

    # -- database
    path = parts.path
    db_text: str | None = None
    if scheme != "unix":
        stripped = path[1:] if path.startswith("/") else path
        if stripped:
            db_text = stripped
    if "db" in query:
        if db_text is not None and db_text != query["db"]:
            raise fail(f"db given twice (path /{db_text} and ?db={query['db']})")
        db_text = query["db"]
    db = 0
    if db_text is not None:
        if not (db_text.isascii() and db_text.isdigit()):
            raise fail(f"db must be a non-negative integer, not {db_text!r}")
        db = int(db_text)

    # -- address
    if scheme == "unix":
        if hostport:
            raise fail(
                f"a unix:// URL takes no host ({hostport!r}); write unix:///path/to/redis.sock"
            )
        sock_path = unquote(path)
        if not sock_path or sock_path == "/":
            raise fail("no socket path; write unix:///path/to/redis.sock")
        return RedisConfig(
            path=sock_path,
            db=db,
            username=username,
            password=password,
            connect_timeout=connect_timeout,
        )

    try:
        port_or_none = parts.port
    except ValueError:
        port_text = hostport.rpartition("]")[2] if hostport.startswith("[") else hostport
        raise fail(
            f"port must be an integer from 1 to 65535, not {port_text.rpartition(':')[2]!r}"
        ) from None
    if port_or_none is not None and not 1 <= port_or_none <= 65535:
        raise fail(f"port must be from 1 to 65535, not {port_or_none}")
    if hostport.endswith(":"):
        raise fail("empty port after ':'")
    host = parts.hostname or "127.0.0.1"
    if hostport.startswith("[") and ":" not in host:
        raise fail(f"brackets are only for IPv6 addresses, not {host!r}")
    return RedisConfig(
        host=host,
        port=port_or_none if port_or_none is not None else 6379,
        db=db,
        username=username,
        password=password,
        tls=tls,
        tls_verify=tls_verify,
        tls_ca_file=tls_ca_file,
        connect_timeout=connect_timeout,
    )
