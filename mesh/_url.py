"""Redis URLs: parse standalone, Sentinel and Cluster URLs into a :class:`RedisConfig`.

Accepted forms::

    redis://[[user]:password@]host[:port][/db][?connect_timeout=SECONDS]
    rediss://[[user]:password@]host[:port][/db][?ssl_cert_reqs=none|required][&ssl_ca_certs=PATH]
            [&ssl_certfile=PATH[&ssl_keyfile=PATH]]   (a client certificate and its key)
    unix://[[user]:password@]/path/to/redis.sock[?db=N][&connect_timeout=SECONDS]
    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/SERVICE[/db]
    rediss+sentinel://...                       (TLS to the sentinels and the master)
    redis+cluster://[[user]:password@]host[:port][,host[:port]...]   (seed nodes; db 0 only)
    rediss+cluster://...                        (TLS)

A plain ``redis://`` URL that names any node of a Redis Cluster works too: the
cluster is detected at connect (its db must be 0). Sentinel ports default to
26379, every other port to 6379.

User and password are percent-decoded; they are the data nodes' credentials (the
master's). When the URL has no password, ``$MESH_REDIS_PASSWORD`` (and, if the URL
has no user, ``$MESH_REDIS_USERNAME``) are used, so that secrets can stay out of
command lines. ``min_replicas=N`` (any form) makes workers and clients confirm
their guarantee-carrying writes with ``WAIT N`` (see ``docs/guarantees.md``).
The sentinels' own credentials, if they need any, come from the
query parameters ``sentinel_username`` and ``sentinel_password`` or, better, from
``$MESH_SENTINEL_PASSWORD`` (and ``$MESH_SENTINEL_USERNAME``).

No error message, no ``str`` and no ``repr`` ever contains a password.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import Any, Final, Literal
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlsplit

import attrs

from ._errors import ConfigError

__all__ = ["RedisConfig", "check_min_replicas", "coerce_config", "parse_url"]

_SENTINEL_PORT = 26379
_QUERY_SECRET = re.compile(r"(sentinel_password=)[^&#]*", re.IGNORECASE)

Topology = Literal["standalone", "sentinel", "cluster"]


@attrs.frozen
class RedisConfig:
    """Where and how to connect to Redis. Build one with :func:`parse_url` or directly.

    ``path`` set means a unix socket (``host`` and ``port`` are then unused).
    ``topology`` says how the master is found: ``"standalone"`` (``host``/``port``,
    which may turn out to be a cluster node: detected at connect), ``"sentinel"``
    (ask the sentinels ``nodes`` for the master ``service``) or ``"cluster"`` (the
    seed ``nodes``). For those two, ``host``/``port`` are the first of ``nodes``.
    Passwords are left out of ``repr`` and ``str``; use :meth:`redacted` in logs
    and messages.
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
    topology: Topology = "standalone"
    nodes: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = attrs.field(default=None, repr=False)
    min_replicas: int = 0
    #: A client certificate (PEM) for a server that asks for one
    #: (``tls-auth-clients``), and its private key (PEM, not encrypted; None:
    #: in the certificate file). ``tls`` only. Paths, never shown with secrets.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def __str__(self) -> str:
        return self.redacted()

    def redacted(self) -> str:
        """A URL for this config that is safe to log: passwords are shown as ``***``.

        Returns:
            For example ``redis://alice:***@[::1]:6380/2``, ``unix:///run/redis.sock?db=1``
            or ``redis+sentinel://:***@h1:26379,h2:26379/mymaster/0``.
        """
        userinfo = ""
        if self.username is not None or self.password is not None:
            user = quote(self.username, safe="") if self.username else ""
            userinfo = user + (":***" if self.password is not None else "") + "@"
        if self.path is not None:
            query = f"?db={self.db}" if self.db else ""
            return f"unix://{userinfo}{quote(self.path)}{query}"
        scheme = "rediss" if self.tls else "redis"
        if self.topology == "standalone":
            return f"{scheme}://{userinfo}{_hostport(self.host, self.port)}/{self.db}"
        hosts = ",".join(_hostport(h, p) for h, p in self.nodes or ((self.host, self.port),))
        if self.topology == "cluster":
            return f"{scheme}+cluster://{userinfo}{hosts}"
        params = []
        if self.sentinel_username is not None:
            params.append(f"sentinel_username={quote(self.sentinel_username, safe='')}")
        if self.sentinel_password is not None:
            params.append("sentinel_password=***")
        query = "?" + "&".join(params) if params else ""
        service = quote(self.service or "", safe="")
        return f"{scheme}+sentinel://{userinfo}{hosts}/{service}/{self.db}{query}"


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
    tail = _QUERY_SECRET.sub(r"\1***", tail)
    return f"{scheme}://{netloc}{tail}"


def parse_url(url: str) -> RedisConfig:
    """Parse a Redis URL.

    Args:
        url: a standalone, Sentinel or Cluster URL (see the module docstring).
            Surrounding whitespace is ignored.

    Returns:
        The parsed configuration.

    Raises:
        ConfigError: the URL is malformed; the one-line message names the part that
            is wrong (scheme, host list, service, port, db, query parameter...) and
            never contains a password.
    """
    if not isinstance(url, str):
        raise ConfigError(f"a Redis URL must be a str, not {type(url).__name__}")
    url = url.strip()
    u = _Url(_scrub(url))
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unbalanced '[' in an IPv6 host
        raise u.fail(f"cannot parse it ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise u.fail(
            f"unsupported scheme {scheme + '://' if scheme else '(none)'}; use redis://, "
            "rediss://, unix://, redis+sentinel://, rediss+sentinel://, redis+cluster:// "
            "or rediss+cluster://"
        )
    if parts.fragment:
        raise u.fail("unexpected #fragment")
    u.scheme, u.tls = scheme, scheme.partition("+")[0] == "rediss"
    u.fields["tls"] = u.tls
    hostport = _credentials(parts.netloc, u)
    _query(parts.query, u)
    for key, option in _OPTIONS.items():
        if key in u.query:
            option(u.query[key], u)
    return _SCHEMES[scheme](parts, hostport, u)


@attrs.define
class _Url:
    """One URL being parsed: what is known so far, and how to refuse it."""

    shown: str  # the URL as an error may show it (no user, no password)
    secrets: list[str] = attrs.Factory(list)  # what an error must never show
    scheme: str = ""
    tls: bool = False
    query: dict[str, str] = attrs.Factory(dict)
    fields: dict[str, Any] = attrs.Factory(dict)  # RedisConfig's arguments

    def fail(self, what: str) -> ConfigError:
        """The one-line error for ``what`` is wrong, with no secret in it."""
        msg = f"bad Redis URL {self.shown}: {what}"
        for secret in self.secrets:
            msg = msg.replace(secret, "***")
        return ConfigError(msg)

    def secret(self, value: str | None) -> str | None:
        """``value`` (a password), remembered so that no error shows it."""
        if value:
            self.secrets.append(value)
        return value


def _credentials(netloc: str, u: _Url) -> str:
    """The user and password of ``netloc`` (or of the environment) into
    ``u.fields``; returns the rest, the host part."""
    userinfo, at, hostport = netloc.rpartition("@")
    if not at:
        userinfo, hostport = "", netloc
    username: str | None = None
    password: str | None = None
    if userinfo:
        user_raw, colon, pass_raw = userinfo.partition(":")
        username = unquote(user_raw) or None
        password = u.secret(unquote(pass_raw) if colon and pass_raw else None)
    if password is None:
        password = u.secret(os.environ.get("MESH_REDIS_PASSWORD") or None)
        if password is not None and username is None:
            username = os.environ.get("MESH_REDIS_USERNAME") or None
    if username is not None and password is None:
        raise u.fail(
            "it has a user name but no password (and $MESH_REDIS_PASSWORD is not set); "
            "for a password alone write redis://:PASSWORD@host"
        )
    u.fields.update(username=username, password=password)
    return hostport


def _query(text: str, u: _Url) -> None:
    """The query's parameters into ``u.query``: known ones, each once."""
    try:
        pairs = parse_qsl(text, keep_blank_values=True, strict_parsing=False)
    except ValueError as exc:
        raise u.fail(f"bad query string ({exc})") from None
    for key, value in pairs:
        if key == "sentinel_password":
            u.secret(value)
    for key, value in pairs:
        if key not in _OPTIONS:
            known = ", ".join(sorted(_OPTIONS))
            raise u.fail(f"unknown query parameter {key!r} (known: {known})")
        if key in u.query:
            raise u.fail(f"query parameter {key!r} given twice")
        u.query[key] = value


# -- query parameters, one parser each (run in the table's order)


def _connect_timeout(text: str, u: _Url) -> None:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise u.fail(f"connect_timeout must be a positive number of seconds, not {text!r}")
    u.fields["connect_timeout"] = value


def _min_replicas(text: str, u: _Url) -> None:
    if not (text.isascii() and text.isdigit()) or int(text) > 1000:
        raise u.fail(f"min_replicas must be an integer from 0 to 1000, not {text!r}")
    u.fields["min_replicas"] = int(text)


def _tls_only(u: _Url) -> None:
    if not u.tls:
        raise u.fail(
            "ssl_cert_reqs, ssl_ca_certs, ssl_certfile and ssl_keyfile are only valid with "
            "rediss:// (or rediss+...)"
        )


def _ssl_certfile(text: str, u: _Url) -> None:
    _tls_only(u)
    if not text:
        raise u.fail("ssl_certfile is empty")
    u.fields["tls_cert_file"] = text


def _ssl_keyfile(text: str, u: _Url) -> None:
    _tls_only(u)
    if not text:
        raise u.fail("ssl_keyfile is empty")
    if "ssl_certfile" not in u.query:
        raise u.fail("ssl_keyfile needs ssl_certfile (the client certificate it belongs to)")
    u.fields["tls_key_file"] = text


def _ssl_cert_reqs(text: str, u: _Url) -> None:
    _tls_only(u)
    if text.lower() not in ("none", "required", "optional"):
        raise u.fail(f"ssl_cert_reqs must be none, optional or required, not {text!r}")
    u.fields["tls_verify"] = text.lower() != "none"


def _ssl_ca_certs(text: str, u: _Url) -> None:
    _tls_only(u)
    if not text:
        raise u.fail("ssl_ca_certs is empty")
    u.fields["tls_ca_file"] = text


def _sentinel_only(name: str) -> Callable[[str, _Url], None]:
    def option(text: str, u: _Url) -> None:
        if not u.scheme.endswith("+sentinel"):
            raise u.fail(
                "sentinel_username and sentinel_password are only valid with redis+sentinel://"
            )
        u.fields[name] = text or None

    return option


def _db_later(text: str, u: _Url) -> None:
    """``db``: read with the path, by the scheme's parser (:func:`_db`)."""


#: Every query parameter and its parser, in the order they are checked.
_OPTIONS: Final[dict[str, Callable[[str, _Url], None]]] = {
    "connect_timeout": _connect_timeout,
    "min_replicas": _min_replicas,
    "ssl_certfile": _ssl_certfile,
    "ssl_keyfile": _ssl_keyfile,
    "ssl_cert_reqs": _ssl_cert_reqs,
    "ssl_ca_certs": _ssl_ca_certs,
    "sentinel_username": _sentinel_only("sentinel_username"),
    "sentinel_password": _sentinel_only("sentinel_password"),
    "db": _db_later,
}


# -- schemes, one parser each: the path (db, service) and the address


def _db(from_path: str | None, u: _Url) -> int:
    """The db, from the path or ``?db=`` (the same if both)."""
    text = from_path
    if "db" in u.query:
        if text is not None and text != u.query["db"]:
            raise u.fail(f"db given twice (path /{text} and ?db={u.query['db']})")
        text = u.query["db"]
    if text is None:
        return 0
    if not (text.isascii() and text.isdigit()):
        raise u.fail(f"db must be a non-negative integer, not {text!r}")
    return int(text)


def _path_db(path: str, u: _Url) -> int:
    """The db of a ``/DB`` path (or of the query)."""
    stripped = path[1:] if path.startswith("/") else path
    return _db(stripped or None, u)


def _host_list(hostport: str, default_port: int, u: _Url) -> tuple[tuple[str, int], ...]:
    """``host[:port][,host[:port]...]``, at least one."""
    if not hostport:
        raise u.fail(f"no host; write {u.scheme}://host[:port][,host[:port]...]")
    nodes: list[tuple[str, int]] = []
    for item in hostport.split(","):
        if not item:
            raise u.fail("an empty entry in the host list (two commas, or a trailing comma)")
        node = _parse_hostport(item, default_port)
        if isinstance(node, str):
            raise u.fail(node)
        nodes.append(node)
    return tuple(nodes)


def _standalone(parts: SplitResult, hostport: str, u: _Url) -> RedisConfig:
    """``redis://`` and ``rediss://``: one host."""
    db = _path_db(parts.path, u)
    if "," in hostport:
        raise u.fail(
            "a host list needs redis+sentinel:// or redis+cluster://; redis:// takes one host"
        )
    try:
        port = parts.port
    except ValueError:
        port_text = hostport.rpartition("]")[2] if hostport.startswith("[") else hostport
        raise u.fail(
            f"port must be an integer from 1 to 65535, not {port_text.rpartition(':')[2]!r}"
        ) from None
    if port is not None and not 1 <= port <= 65535:
        raise u.fail(f"port must be from 1 to 65535, not {port}")
    if hostport.endswith(":"):
        raise u.fail("empty port after ':'")
    host = parts.hostname or "127.0.0.1"
    if hostport.startswith("[") and ":" not in host:
        raise u.fail(f"brackets are only for IPv6 addresses, not {host!r}")
    return RedisConfig(host=host, port=6379 if port is None else port, db=db, **u.fields)


def _unix(parts: SplitResult, hostport: str, u: _Url) -> RedisConfig:
    """``unix://``: a socket path; the db only in the query."""
    db = _db(None, u)
    if hostport:
        raise u.fail(
            f"a unix:// URL takes no host ({hostport!r}); write unix:///path/to/redis.sock"
        )
    path = unquote(parts.path)
    if not path or path == "/":
        raise u.fail("no socket path; write unix:///path/to/redis.sock")
    return RedisConfig(path=path, db=db, **u.fields)


def _sentinel(parts: SplitResult, hostport: str, u: _Url) -> RedisConfig:
    """``redis+sentinel://``: sentinels, ``/SERVICE[/DB]``, the sentinels' credentials."""
    fields = u.fields
    if fields.get("sentinel_password") is None:
        fields["sentinel_password"] = u.secret(os.environ.get("MESH_SENTINEL_PASSWORD") or None)
        if fields["sentinel_password"] is not None and fields.get("sentinel_username") is None:
            fields["sentinel_username"] = os.environ.get("MESH_SENTINEL_USERNAME") or None
    if fields.get("sentinel_username") is not None and fields["sentinel_password"] is None:
        raise u.fail(
            "sentinel_username given without sentinel_password (nor $MESH_SENTINEL_PASSWORD)"
        )
    path = parts.path
    segments = path.split("/")[1:] if path.startswith("/") else []
    if segments and segments[-1] == "":
        segments.pop()  # a trailing slash
    if not segments or not segments[0]:
        raise u.fail(
            "no service name; write redis+sentinel://host[:port][,host[:port]...]/SERVICE[/DB]"
        )
    if len(segments) > 2:
        raise u.fail(f"too many path parts {path!r}; expected /SERVICE[/DB]")
    db = _db(segments[1] if len(segments) == 2 else None, u)
    nodes = _host_list(hostport, _SENTINEL_PORT, u)
    return RedisConfig(
        host=nodes[0][0],
        port=nodes[0][1],
        db=db,
        topology="sentinel",
        nodes=nodes,
        service=unquote(segments[0]),
        **fields,
    )


def _cluster(parts: SplitResult, hostport: str, u: _Url) -> RedisConfig:
    """``redis+cluster://``: seed nodes, db 0 only."""
    db = _path_db(parts.path, u)
    if db != 0:
        raise u.fail(f"a Redis Cluster has only db 0, not {db}")
    nodes = _host_list(hostport, 6379, u)
    return RedisConfig(
        host=nodes[0][0], port=nodes[0][1], topology="cluster", nodes=nodes, **u.fields
    )


#: The parser of each scheme.
_SCHEMES: Final[dict[str, Callable[[SplitResult, str, _Url], RedisConfig]]] = {
    "redis": _standalone,
    "rediss": _standalone,
    "unix": _unix,
    "redis+sentinel": _sentinel,
    "rediss+sentinel": _sentinel,
    "redis+cluster": _cluster,
    "rediss+cluster": _cluster,
}


def _parse_hostport(item: str, default_port: int) -> tuple[str, int] | str:
    """``host[:port]`` or ``[v6][:port]``; a string is the reason it is bad."""
    if item.startswith("["):
        host, bracket, rest = item[1:].partition("]")
        if not bracket:
            return f"unbalanced '[' in {item!r}"
        if ":" not in host:
            return f"brackets are only for IPv6 addresses, not {host!r}"
        if rest and not rest.startswith(":"):
            return f"unexpected {rest!r} after {host!r}"
        port_text = rest[1:] if rest else None
    else:
        host, colon, port_text_ = item.rpartition(":")
        if not colon:
            host, port_text = item, None
        else:
            port_text = port_text_
        if ":" in host:
            return f"an IPv6 address needs brackets: [{host}]"
    if not host:
        return f"an empty host in {item!r}"
    if port_text is None:
        return host.lower(), default_port
    if not port_text:
        return "empty port after ':'"
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        return f"port must be an integer from 1 to 65535, not {port_text!r}"
    return host.lower(), int(port_text)


def coerce_config(config: RedisConfig | str) -> RedisConfig:
    """A :class:`RedisConfig` from a config or a URL: how every ``open_*``
    (client, worker, fleet, connection, pub/sub) reads its ``url`` argument,
    once, at its entry; beneath it only a :class:`RedisConfig` travels.

    Raises:
        ConfigError: a malformed URL, or neither a str nor a RedisConfig.
    """
    if isinstance(config, str):
        return parse_url(config)
    if not isinstance(config, RedisConfig):
        raise ConfigError(f"expected a RedisConfig or a URL, not {type(config).__name__}")
    return config


def check_min_replicas(config: RedisConfig, min_replicas: int | None) -> int:
    """``min_replicas`` if given, else the URL's; ConfigError unless an int >= 0."""
    if min_replicas is None:
        return config.min_replicas
    if type(min_replicas) is not int or min_replicas < 0:
        raise ConfigError(f"min_replicas must be an integer >= 0, not {min_replicas!r}")
    return min_replicas
