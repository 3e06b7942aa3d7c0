"""The option checks of mesh._validate and the config classes that use them
(QueuePolicy, QueueConfig, Batched), and the functions that check a loose
argument with them. Pure: no Redis."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

import mesh
from mesh._balance import check_capacity, check_weight
from mesh._client_writes import _due, check_priority
from mesh._errors import ConfigError, ProtocolError
from mesh._lease import LeaseTiming
from mesh._policy import QueuePolicy, parse_policy, policy_fields
from mesh._queue_config import served_options
from mesh._runner import QueueConfig
from mesh._schedule import spec_of
from mesh._types import Process
from mesh._validate import (
    is_number,
    is_whole,
    seconds,
    seconds_field,
    whole,
    whole_field,
)
from mesh._worker import worker_options

NOT_NUMBERS: tuple[object, ...] = (True, False, "1", None, b"1", [1])


async def handler(p: Process) -> None:
    pass


async def batch_handler(ps: list[Process]) -> None:
    pass


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


# --- the helpers -----------------------------------------------------------


def test_is_whole_and_is_number_refuse_bools() -> None:
    assert is_whole(0) and is_whole(-3) and is_whole(10**20)
    assert not any(is_whole(v) for v in (True, False, 1.0, "1", None))
    assert is_number(0) and is_number(1.5) and is_number(math.inf)
    assert not any(is_number(v) for v in (True, False, "1", None))


def test_whole_accepts_the_range_and_returns_the_value() -> None:
    assert whole("n", 0) == 0
    assert whole("n", 5, 1) == 5
    assert whole("n", 1, 1, 9) == 1 and whole("n", 9, 1, 9) == 9


@pytest.mark.parametrize("bad", [*NOT_NUMBERS, 1.0, 0.5, -1])
def test_whole_refuses_with_one_line_naming_the_argument(bad: object) -> None:
    with pytest.raises(ConfigError) as exc:
        whole("concurrency", bad)
    assert one_line(exc) == f"concurrency must be a whole number >= 0, got {bad!r}"


def test_whole_names_the_range_and_the_error_class() -> None:
    with pytest.raises(ConfigError, match=r"^n must be a whole number >= 1, got 0$"):
        whole("n", 0, 1)
    with pytest.raises(ConfigError, match=r"^w must be a whole number from 1 to 1,000,000, got"):
        whole("w", 1_000_001, 1, 1_000_000)
    with pytest.raises(TypeError, match=r"^size must be a whole number >= 1, got True$"):
        whole("size", True, 1, error=TypeError)


def test_seconds_accepts_finite_numbers_from_low() -> None:
    assert seconds("t", 0) == 0
    assert seconds("t", 2.5) == 2.5
    assert seconds("t", 0.05, 0.05) == 0.05


@pytest.mark.parametrize("bad", [-1, -0.001, math.inf, -math.inf, math.nan])
def test_seconds_refuses_out_of_range(bad: float) -> None:
    with pytest.raises(ConfigError) as exc:
        seconds("timeout", bad)
    assert one_line(exc) == f"timeout must be a finite number of seconds >= 0, got {bad!r}"


@pytest.mark.parametrize("bad", NOT_NUMBERS)
def test_seconds_refuses_what_is_not_a_number(bad: object) -> None:
    with pytest.raises(ConfigError) as exc:
        seconds("timeout", bad)
    assert one_line(exc) == f"timeout must be a number of seconds, got {bad!r}"
    with pytest.raises(TypeError) as texc:
        seconds("delay", bad, wrong_type=TypeError)
    assert one_line(texc) == f"delay must be a number of seconds, not {type(bad).__name__}"
    assert not isinstance(texc.value, ConfigError)


def test_seconds_names_its_lower_bound() -> None:
    with pytest.raises(ConfigError, match=r"^every must be a finite number of seconds >= 0\.05"):
        seconds("every", 0.01, 0.05)


def test_the_field_validators_name_the_field() -> None:
    @attrs.frozen
    class C:
        count: int = attrs.field(default=1, validator=whole_field(1, 3))
        wait: float = attrs.field(default=0.0, validator=seconds_field())

    assert C(3, 1.5) == C(3, 1.5)
    with pytest.raises(ConfigError, match=r"^count must be a whole number from 1 to 3, got 4$"):
        C(4)
    with pytest.raises(ConfigError, match=r"^wait must be a finite number of seconds >= 0"):
        C(wait=-1)
    with pytest.raises(ConfigError, match=r"^wait must be a number of seconds, got True$"):
        C(wait=True)


# --- QueuePolicy ------------------------------------------------------------


def test_queue_policy_defaults_are_valid_and_public() -> None:
    p = mesh.QueuePolicy()
    assert (p.max_attempts, p.backoff, p.backoff_max) == (5, 1.0, 60.0)
    assert mesh.QueuePolicy(2, 0.5, 60.0, 3, 60) == mesh.QueuePolicy(2, 0.5, 60, 3.0, 60.0)


@pytest.mark.parametrize(
    ("field", "bad", "rule"),
    [
        ("max_attempts", -1, "a whole number >= 0"),
        ("max_attempts", True, "a whole number >= 0"),
        ("max_attempts", 2.0, "a whole number >= 0"),
        ("backoff", -0.5, "a finite number of seconds >= 0"),
        ("backoff_max", math.inf, "a finite number of seconds >= 0"),
        ("timeout", math.nan, "a finite number of seconds >= 0"),
        ("result_ttl", "60", "a number of seconds"),
        ("rate_limit", -1, "a whole number >= 0"),
        ("rate_period", -1, "a finite number of seconds >= 0"),
    ],
)
def test_queue_policy_refuses_a_bad_field(field: str, bad: object, rule: str) -> None:
    with pytest.raises(ConfigError) as exc:
        QueuePolicy(**{field: bad})  # type: ignore[arg-type]
    assert one_line(exc) == f"{field} must be {rule}, got {bad!r}"


def test_queue_policy_refuses_backoff_above_backoff_max() -> None:
    with pytest.raises(ConfigError, match=r"^need backoff <= backoff_max, got 5, 1$"):
        QueuePolicy(backoff=5, backoff_max=1)
    with pytest.raises(TypeError):
        QueuePolicy(source=3)  # type: ignore[arg-type]


def test_parse_policy_refuses_stored_values_out_of_range() -> None:
    good = (
        b'{"max_attempts": 2, "backoff_ms": 10, "backoff_max_ms": 20, "timeout_ms": 0,'
        b' "result_ttl_ms": 0}'
    )
    assert parse_policy(good, "q") == QueuePolicy(2, 0.01, 0.02, 0.0, 0.0)
    bad = good.replace(b'"max_attempts": 2', b'"max_attempts": -2')
    with pytest.raises(ProtocolError, match="malformed policy of queue q: max_attempts must be"):
        parse_policy(bad, "q")
    swapped = good.replace(b'"backoff_ms": 10', b'"backoff_ms": 30')
    with pytest.raises(ProtocolError, match="need backoff <= backoff_max"):
        parse_policy(swapped, "q")


def test_policy_fields_turn_seconds_into_ms_and_check_each_option() -> None:
    assert policy_fields(max_attempts=3, backoff=0.5, timeout=None) == [
        "max_attempts",
        3,
        "backoff_ms",
        500,
    ]
    assert policy_fields(rate_limit=(10, 2)) == ["rate_limit", 10, "rate_period_ms", 2000]
    assert policy_fields(rate_limit=5) == ["rate_limit", 5, "rate_period_ms", 1000]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"max_attempts": -1}, "max_attempts must be a whole number >= 0, got -1"),
        ({"max_attempts": True}, "max_attempts must be a whole number >= 0, got True"),
        ({"timeout": math.inf}, "timeout must be a number of seconds from 0 to 315,360,000"),
        ({"result_ttl": "1"}, "result_ttl must be a number of seconds, not str"),
        ({"rate_limit": -1}, "rate_limit must be N or (N, seconds) with N >= 0, got -1"),
        ({"rate_limit": (True, 1)}, "rate_limit must be N or (N, seconds) with N >= 0"),
        ({"rate_limit": (1, 0.0001)}, "the rate_limit period must be at least 1 ms"),
        ({"rate_limit": (1, -1)}, "rate_limit period must be a number of seconds from 0 to"),
        ({"backoff": 5, "backoff_max": 1}, "need backoff <= backoff_max, got 5, 1"),
        ({"colour": 1}, "unknown policy option colour"),
    ]
    for given, message in cases:
        with pytest.raises(ConfigError) as exc:
            policy_fields(**given)
        assert one_line(exc).startswith(message), given


# --- QueueConfig and Batched --------------------------------------------------


def config(**changes: Any) -> QueueConfig:
    base: dict[str, Any] = {
        "queue": "q",
        "handler": handler,
        "concurrency": 10,
        "max_attempts": 5,
        "backoff": 1.0,
        "backoff_max": 60.0,
    }
    return QueueConfig(**(base | changes))


def test_queue_config_takes_the_start_work_defaults() -> None:
    c = config()
    assert (c.concurrency, c.batch, c.prefetch, c.capacity) == (10, 0, None, 1)
    assert config(handler=None).handler is None
    assert config(handler=batch_handler, batch=10).batch == 10
    assert config(prefetch=5).prefetch == 5


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"concurrency": 0}, "concurrency must be a whole number >= 1, got 0"),
        ({"concurrency": True}, "concurrency must be a whole number >= 1, got True"),
        ({"concurrency": 2.5}, "concurrency must be a whole number >= 1, got 2.5"),
        ({"max_attempts": -1}, "max_attempts must be a whole number >= 0, got -1"),
        ({"backoff": -1}, "backoff must be a finite number of seconds >= 0, got -1"),
        ({"backoff_max": math.nan}, "backoff_max must be a finite number of seconds >= 0"),
        ({"timeout": math.inf}, "timeout must be a finite number of seconds >= 0, got inf"),
        ({"result_ttl": -1}, "result_ttl must be a finite number of seconds >= 0, got -1"),
        ({"batch": -1}, "batch must be a whole number >= 0, got -1"),
        ({"prefetch": -1}, "prefetch must be a whole number >= 0, got -1"),
        ({"prefetch": False}, "prefetch must be a whole number >= 0, got False"),
        ({"capacity": 0}, "capacity must be a whole number from 1 to 1,000,000, got 0"),
        ({"queue": "a b"}, "invalid queue name 'a b'"),
        ({"batch": 11}, "batch (11) is more than concurrency (10), the most processes at once"),
        ({"batch": 2, "prefetch": 1}, "prefetch is for plain handlers"),
        ({"backoff": 2, "backoff_max": 1}, "need backoff <= backoff_max, got 2, 1"),
    ],
)
def test_queue_config_refuses_with_one_line(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config(**changes)
    assert one_line(exc).startswith(message)


def test_queue_config_refuses_a_handler_that_is_not_async() -> None:
    def plain(p: Process) -> None:
        pass

    with pytest.raises(TypeError, match=r"handler \S*plain is not async"):
        config(handler=plain)
    with pytest.raises(TypeError, match="must be an async callable"):
        config(handler=3)
    with pytest.raises(TypeError, match="queue name must be a str"):
        config(queue=3)


def test_with_policy_keeps_a_valid_config() -> None:
    p = QueuePolicy(2, 0.5, 1.0, 3.0, 60.0, rate_limit=4, rate_period=0.5)
    c = config().with_policy(p)
    assert (c.max_attempts, c.backoff, c.backoff_max, c.timeout, c.result_ttl) == (
        2,
        0.5,
        1.0,
        3.0,
        60.0,
    )
    assert c.rate == (4, 500)
    assert config().with_policy(QueuePolicy()).rate is None


def test_served_options_turn_start_work_arguments_into_a_config() -> None:
    none = {"max_attempts": None, "backoff": None, "backoff_max": None}
    cfg, local, explicit = served_options("q", handler, None, None, 10, none)
    assert (cfg.handler, cfg.concurrency, cfg.batch, cfg.max_attempts) == (handler, 10, 0, 5)
    assert (local, explicit) == (QueuePolicy(), {})
    given = none | {"backoff": 0.5}
    cfg, local, explicit = served_options(
        "q", None, batch_handler, None, 4, given, capacity=2, rebalance=False
    )
    assert (cfg.handler, cfg.concurrency, cfg.batch, cfg.backoff) == (batch_handler, 4, 4, 0.5)
    assert (cfg.capacity, cfg.rebalance, local.backoff, explicit) == (
        2,
        False,
        0.5,
        {"backoff": 0.5},
    )
    with pytest.raises(ConfigError, match="a handler or a batch_handler, not both"):
        served_options("q", handler, batch_handler, None, 10, none)
    with pytest.raises(ConfigError, match="batch must be a whole number >= 1, got 0"):
        served_options("q", None, batch_handler, None, 0, none)
    with pytest.raises(ConfigError, match="backoff"):  # checked as Client.configure does
        served_options("q", handler, None, None, 10, none | {"backoff": -1})


def test_batched_checks_its_handler_and_size() -> None:
    assert mesh.Batched(batch_handler).size == 10
    assert mesh.Batched(batch_handler, 1).size == 1
    for bad in (0, -1, True, 2.0):
        with pytest.raises(TypeError) as exc:
            mesh.Batched(batch_handler, bad)  # type: ignore[arg-type]
        assert one_line(exc) == f"batch size must be a whole number >= 1, got {bad!r}"
    with pytest.raises(TypeError, match="not async"):
        mesh.Batched(lambda ps: None)  # type: ignore[arg-type, return-value]


# --- the other callers of the helpers ------------------------------------------


def test_weight_capacity_and_priority_ranges() -> None:
    check_weight(1)
    check_capacity(1_000_000)
    assert check_priority(0) == 0 and check_priority(9) == 9
    for check, what in ((check_weight, "weight"), (check_capacity, "capacity")):
        for bad in (0, 1_000_001, True, 1.0):
            with pytest.raises(
                ConfigError, match=rf"^{what} must be a whole number from 1 to 1,000"
            ):
                check(bad)
    for bad_priority in (-1, 10, True, "1"):
        with pytest.raises(ConfigError, match=r"^priority must be a whole number from 0 to 9"):
            check_priority(bad_priority)


def test_due_checks_delay_and_at() -> None:
    assert _due(None, None) is None
    assert _due(1.5, None) == (1500, None)
    assert _due(None, 2) == (0, 2000)
    with pytest.raises(ConfigError, match=r"^give delay or at, not both$"):
        _due(1, 1)
    with pytest.raises(
        ConfigError, match=r"^delay must be a number of seconds from 0 to 315,360,000 \(10 years\)"
    ):
        _due(-1, None)
    with pytest.raises(TypeError, match=r"^delay must be a number of seconds, not bool$"):
        _due(True, None)
    with pytest.raises(
        ConfigError, match=r"^at must be a Unix time in seconds from 0 to 253,402,300,799"
    ):
        _due(None, math.inf)
    with pytest.raises(TypeError, match=r"^at must be a datetime or a Unix time, not str$"):
        _due(None, "now")  # type: ignore[arg-type]


def test_schedule_every_is_checked() -> None:
    assert spec_of(0.05, None) == "every 50"
    with pytest.raises(
        ConfigError, match=r"^every must be a number of seconds from 0\.05 to 315,360,000"
    ):
        spec_of(0.01, None)
    with pytest.raises(TypeError, match=r"^every must be a number of seconds, not bool$"):
        spec_of(True, None)
    with pytest.raises(ConfigError, match="exactly one"):
        spec_of(None, None)


def test_worker_options_check_the_graces() -> None:
    assert worker_options("w1", 0, 0) == "w1"
    assert worker_options(None, 1.5, 0).count("-") >= 2
    for bad in (-1, math.nan, math.inf, "1", True):
        with pytest.raises(ConfigError, match=r"^stop_grace must be a"):
            worker_options("w1", bad, 0)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"^rejoin_grace must be a"):
            worker_options("w1", 0, bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs a stable worker_id"):
        worker_options(None, 0, 5)


def test_lease_timing_ttl_must_be_a_number() -> None:
    assert LeaseTiming.make(3, None, None) == LeaseTiming(3, 1.0, 2.0)
    with pytest.raises(TypeError, match=r"^ttl must be a number of seconds, not bool$"):
        LeaseTiming.make(True, None, None)
