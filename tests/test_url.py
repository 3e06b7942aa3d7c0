"""mesh._url: every accepted form, and bad URLs that never leak the password."""

from __future__ import annotations

import pytest

from mesh._errors import ConfigError
from mesh._url import RedisConfig, check_min_replicas, coerce_config, parse_url

SECRET = "s3cr3t-Pa55"


@pytest.fixture(autouse=True)
def _no_env_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESH_REDIS_PASSWORD", raising=False)
    monkeypatch.delenv("MESH_REDIS_USERNAME", raising=False)


def test_defaults() -> None:
    assert parse_url("redis://") == RedisConfig()
    assert parse_url("redis://localhost") == RedisConfig(host="localhost")


def test_redis_full() -> None:
    cfg = parse_url(f"redis://alice:{SECRET}@example.com:6380/3?connect_timeout=0.5")
    assert cfg == RedisConfig(
        host="example.com",
        port=6380,
        db=3,
        username="alice",
        password=SECRET,
        connect_timeout=0.5,
    )
    assert not cfg.tls


def test_password_only() -> None:
    cfg = parse_url(f"redis://:{SECRET}@h:1")
    assert cfg.username is None
    assert cfg.password == SECRET
    assert cfg.port == 1


def test_db_in_path_or_query() -> None:
    assert parse_url("redis://h/5").db == 5
    assert parse_url("redis://h?db=7").db == 7
    assert parse_url("redis://h/7?db=7").db == 7
    assert parse_url("redis://h/").db == 0


def test_percent_decoding() -> None:
    cfg = parse_url("redis://us%40er:p%3Aw%2Fd%40%25@h")
    assert cfg.username == "us@er"
    assert cfg.password == "p:w/d@%"


def test_password_with_raw_at_sign() -> None:
    # The last '@' ends the userinfo (like urllib and redis-py).
    cfg = parse_url("redis://u:pa@ss@h:7")
    assert cfg.password == "pa@ss"
    assert cfg.host == "h"


def test_ipv6() -> None:
    cfg = parse_url("redis://[::1]:6390/2")
    assert cfg.host == "::1"
    assert cfg.port == 6390
    assert cfg.redacted() == "redis://[::1]:6390/2"
    assert parse_url("redis://[fe80::1]").port == 6379


def test_rediss() -> None:
    cfg = parse_url("rediss://h:6390")
    assert cfg.tls
    assert cfg.tls_verify
    assert cfg.tls_ca_file is None
    cfg = parse_url("rediss://h?ssl_cert_reqs=none&ssl_ca_certs=/etc/ca.pem")
    assert not cfg.tls_verify
    assert cfg.tls_ca_file == "/etc/ca.pem"
    assert parse_url("rediss://h?ssl_cert_reqs=required").tls_verify
    assert parse_url("rediss://h?ssl_cert_reqs=NONE").tls_verify is False


def test_unix() -> None:
    cfg = parse_url("unix:///run/redis/redis.sock?db=2&connect_timeout=1")
    assert cfg == RedisConfig(path="/run/redis/redis.sock", db=2, connect_timeout=1.0)
    cfg = parse_url(f"unix://bob:{SECRET}@/tmp/r%20s.sock")
    assert cfg.path == "/tmp/r s.sock"
    assert cfg.username == "bob"
    assert cfg.password == SECRET
    assert cfg.redacted() == "unix://bob:***@/tmp/r%20s.sock"


def test_scheme_case_and_whitespace() -> None:
    assert parse_url("  REDIS://h:2\n").port == 2


def test_env_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESH_REDIS_PASSWORD", SECRET)
    monkeypatch.setenv("MESH_REDIS_USERNAME", "envuser")
    cfg = parse_url("redis://h")
    assert (cfg.username, cfg.password) == ("envuser", SECRET)
    # A user in the URL wins over the environment's user; the password comes from the env.
    cfg = parse_url("redis://urluser@h")
    assert (cfg.username, cfg.password) == ("urluser", SECRET)
    # A password in the URL wins over both.
    cfg = parse_url("redis://:fromurl@h")
    assert (cfg.username, cfg.password) == (None, "fromurl")


def test_env_password_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESH_REDIS_PASSWORD", SECRET)
    cfg = parse_url("unix:///s.sock")
    assert (cfg.username, cfg.password) == (None, SECRET)


def test_repr_and_redacted_hide_password() -> None:
    cfg = parse_url(f"rediss://alice:{SECRET}@h:1/2")
    assert SECRET not in repr(cfg)
    assert SECRET not in cfg.redacted()
    assert cfg.redacted() == "rediss://alice:***@h:1/2"
    assert parse_url(f"redis://:{SECRET}@h").redacted() == "redis://:***@h:6379/0"


@pytest.mark.parametrize(
    ("url", "what"),
    [
        (f"http://u:{SECRET}@h", "scheme"),
        (f"h:{SECRET}", "scheme"),
        (f"redis://u:{SECRET}@h:abc", "port"),
        (f"redis://u:{SECRET}@h:0", "port"),
        (f"redis://u:{SECRET}@h:70000", "port"),
        (f"redis://u:{SECRET}@h:", "port"),
        (f"redis://u:{SECRET}@h/x", "db"),
        (f"redis://u:{SECRET}@h/-1", "db"),
        (f"redis://u:{SECRET}@h/1?db=2", "db"),
        (f"redis://u:{SECRET}@h?foo=1", "foo"),
        (f"redis://u:{SECRET}@h?db=1&db=1", "twice"),
        (f"redis://u:{SECRET}@h?connect_timeout=0", "connect_timeout"),
        (f"redis://u:{SECRET}@h?connect_timeout=x", "connect_timeout"),
        (f"redis://u:{SECRET}@h?connect_timeout=inf", "connect_timeout"),
        (f"redis://u:{SECRET}@h?ssl_cert_reqs=none", "rediss"),
        (f"rediss://u:{SECRET}@h?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
        (f"rediss://u:{SECRET}@h?ssl_ca_certs=", "ssl_ca_certs"),
        (f"unix://u:{SECRET}@host/tmp/s.sock", "host"),
        (f"unix://u:{SECRET}@", "path"),
        (f"redis://u:{SECRET}@[::1", "parse"),
        (f"redis://u:{SECRET}@h#frag", "fragment"),
        (f"redis://u:{SECRET}@[example.com]", "IPv6"),
        # A lone user name may really be a password: it must not be shown either.
        (f"redis://{SECRET}@h", "password"),
    ],
)
def test_bad_urls(url: str, what: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_url(url)
    message = str(info.value)
    assert what in message
    assert SECRET not in message
    assert info.value.__cause__ is None or SECRET not in str(info.value.__cause__)
    assert info.value.__context__ is None or SECRET not in str(info.value.__context__)


def test_not_a_string() -> None:
    with pytest.raises(ConfigError, match="str"):
        parse_url(b"redis://h")  # type: ignore[arg-type]


# ---------------------------------------------------------------- Sentinel and Cluster


@pytest.fixture(autouse=True)
def _no_env_sentinel_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESH_SENTINEL_PASSWORD", raising=False)
    monkeypatch.delenv("MESH_SENTINEL_USERNAME", raising=False)


def test_sentinel_full() -> None:
    cfg = parse_url(
        f"redis+sentinel://alice:{SECRET}@s1,s2:26380,[::1]:5/my%20master/2"
        f"?sentinel_username=sent&sentinel_password={SECRET}x&connect_timeout=2"
    )
    assert cfg.topology == "sentinel"
    assert cfg.nodes == (("s1", 26379), ("s2", 26380), ("::1", 5))
    assert (cfg.host, cfg.port) == ("s1", 26379)
    assert cfg.service == "my master"
    assert cfg.db == 2
    assert (cfg.username, cfg.password) == ("alice", SECRET)
    assert (cfg.sentinel_username, cfg.sentinel_password) == ("sent", SECRET + "x")
    assert cfg.connect_timeout == 2
    assert not cfg.tls
    for shown in (repr(cfg), str(cfg), cfg.redacted()):
        assert SECRET not in shown
    assert cfg.redacted() == (
        "redis+sentinel://alice:***@s1:26379,s2:26380,[::1]:5/my%20master/2"
        "?sentinel_username=sent&sentinel_password=***"
    )


def test_sentinel_defaults_and_tls() -> None:
    cfg = parse_url("rediss+sentinel://h/svc/?ssl_cert_reqs=none")
    assert cfg.tls and not cfg.tls_verify
    assert cfg.nodes == (("h", 26379),)
    assert (cfg.service, cfg.db) == ("svc", 0)
    assert cfg.sentinel_password is None
    assert cfg.redacted() == "rediss+sentinel://h:26379/svc/0"


def test_sentinel_password_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESH_SENTINEL_PASSWORD", SECRET)
    monkeypatch.setenv("MESH_SENTINEL_USERNAME", "sentuser")
    cfg = parse_url("redis+sentinel://h/svc")
    assert (cfg.sentinel_username, cfg.sentinel_password) == ("sentuser", SECRET)
    assert cfg.password is None  # the master's password is a different thing
    assert SECRET not in repr(cfg) and SECRET not in str(cfg)


def test_cluster_seeds() -> None:
    cfg = parse_url(f"rediss+cluster://:{SECRET}@a:7000,b,C:7002")
    assert cfg.topology == "cluster"
    assert cfg.nodes == (("a", 7000), ("b", 6379), ("c", 7002))
    assert cfg.tls and cfg.db == 0
    assert cfg.redacted() == "rediss+cluster://:***@a:7000,b:6379,c:7002"
    assert parse_url("redis+cluster://a/0").db == 0
    assert SECRET not in repr(cfg)


def test_plain_url_stays_standalone() -> None:
    cfg = parse_url("redis://h:7000")
    assert cfg.topology == "standalone"
    assert cfg.nodes == ()
    assert str(cfg) == "redis://h:7000/0"


@pytest.mark.parametrize(
    ("url", "what"),
    [
        (f"redis+sentinel://u:{SECRET}@h", "service name"),
        (f"redis+sentinel://u:{SECRET}@h/", "service name"),
        (f"redis+sentinel://u:{SECRET}@h/s/1/2", "too many path parts"),
        (f"redis+sentinel://u:{SECRET}@h/s/x", "db must be"),
        (f"redis+sentinel://u:{SECRET}@h,,k/s", "empty entry"),
        (f"redis+sentinel://u:{SECRET}@h,/s", "empty entry"),
        (f"redis+sentinel://u:{SECRET}@/s", "no host"),
        (f"redis+sentinel://u:{SECRET}@h:0/s", "port"),
        (f"redis+sentinel://u:{SECRET}@h:x/s", "port"),
        (f"redis+sentinel://u:{SECRET}@h:/s", "empty port"),
        (f"redis+sentinel://u:{SECRET}@::1/s", "brackets"),
        (f"redis+sentinel://u:{SECRET}@[host]/s", "IPv6"),
        (f"redis+sentinel://u:{SECRET}@h/s?sentinel_username=x", "sentinel_password"),
        (f"redis+sentinel://h/s?sentinel_password={SECRET}&foo=1", "foo"),
        (f"redis+sentinel://h/s?sentinel_password={SECRET}&sentinel_password=2", "twice"),
        (f"redis+cluster://u:{SECRET}@a,b/1", "only db 0"),
        (f"redis+cluster://u:{SECRET}@a?db=3", "only db 0"),
        (f"redis+cluster://a?sentinel_password={SECRET}", "only valid with redis+sentinel"),
        (f"redis://u:{SECRET}@a,b", "host list"),
        (f"redis+cluster://u:{SECRET}@a?ssl_cert_reqs=none", "rediss"),
        (f"redis+replica://u:{SECRET}@a", "scheme"),
    ],
)
def test_bad_topology_urls(url: str, what: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_url(url)
    message = str(info.value)
    assert what in message
    assert SECRET not in message
    assert "\n" not in message


def test_min_replicas_query() -> None:
    assert parse_url("redis://h").min_replicas == 0
    assert parse_url("redis://h?min_replicas=2").min_replicas == 2
    assert parse_url("redis+sentinel://s/m?min_replicas=1").min_replicas == 1
    assert parse_url("redis+cluster://a,b?min_replicas=1").min_replicas == 1
    assert parse_url("unix:///s.sock?min_replicas=1").min_replicas == 1
    for bad in ("x", "-1", "1.5", "", "100000"):
        with pytest.raises(ConfigError, match="min_replicas must be an integer"):
            parse_url(f"redis://u:{SECRET}@h?min_replicas={bad}")


def test_coerce_config_and_min_replicas() -> None:
    config = coerce_config("redis://127.0.0.1:7000?min_replicas=2")
    assert isinstance(config, RedisConfig) and config.port == 7000
    assert coerce_config(config) is config
    with pytest.raises(ConfigError, match="expected a RedisConfig or a URL, not int"):
        coerce_config(7000)  # type: ignore[arg-type]
    assert check_min_replicas(config, None) == 2
    assert check_min_replicas(config, 0) == 0
    for bad in (-1, True, 1.0):
        with pytest.raises(ConfigError, match="min_replicas must be an integer >= 0"):
            check_min_replicas(config, bad)  # type: ignore[arg-type]


def test_client_certificate() -> None:
    cfg = parse_url("rediss://h?ssl_certfile=/c.pem&ssl_keyfile=/k.pem&ssl_cert_reqs=optional")
    assert (cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_verify) == ("/c.pem", "/k.pem", True)
    assert parse_url("rediss+cluster://a?ssl_certfile=/c.pem").tls_key_file is None
    assert parse_url("rediss+sentinel://s/m?ssl_certfile=/c.pem").tls_cert_file == "/c.pem"


@pytest.mark.parametrize(
    ("url", "what"),
    [
        (f"rediss://u:{SECRET}@h?ssl_keyfile=/k.pem", "ssl_keyfile needs ssl_certfile"),
        (f"rediss://u:{SECRET}@h?ssl_certfile=", "ssl_certfile is empty"),
        (f"rediss://u:{SECRET}@h?ssl_certfile=/c&ssl_keyfile=", "ssl_keyfile is empty"),
        (f"redis://u:{SECRET}@h?ssl_certfile=/c", "only valid with rediss://"),
        (f"unix://u:{SECRET}@/s.sock?ssl_ca_certs=/ca", "only valid with rediss://"),
        (f"unix://u:{SECRET}@/s.sock?db=x", "db must be"),
        (f"redis://u:{SECRET}@h?sentinel_username=x", "only valid with redis+sentinel"),
        (f"redis://u:{SECRET}@h?%zz", "unknown query parameter"),
        (f"redis+cluster://u:{SECRET}@", "no host"),
        # the checks run in a fixed order: the first one that fails is named
        (f"redis://u:{SECRET}@h:x/y?connect_timeout=0", "connect_timeout"),
        (f"redis+sentinel://u:{SECRET}@h/s?sentinel_username=x&db=y", "sentinel_password"),
    ],
)
def test_bad_options(url: str, what: str) -> None:
    test_bad_topology_urls(url, what)  # the same checks: named, one line, no secret


def test_sentinel_password_from_env_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESH_SENTINEL_PASSWORD", SECRET)
    with pytest.raises(ConfigError, match="port") as info:
        parse_url(f"redis+sentinel://h:x/{SECRET}")
    assert SECRET not in str(info.value)


def test_user_without_password() -> None:
    with pytest.raises(ConfigError, match="user name but no password"):
        parse_url("redis://alice@h")
