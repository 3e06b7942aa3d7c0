"""mesh._redirect: which "not executed here" reply means what, where it goes and
how long it waits; plain unit tests, no Redis, no clock but the times passed in."""

from __future__ import annotations

import pytest

from mesh._errors import CommandError
from mesh._redirect import (
    BACKOFF_CAP,
    NOT_HERE,
    Ask,
    Resend,
    Retry,
    ask_target,
    is_transaction,
    not_here,
    reroute_pause,
    sentinel_poll_interval,
)

HERE = ("10.0.0.1", 7000)


def err(message: str) -> CommandError:
    return CommandError(message, code=message.split(" ", 1)[0])


def test_not_here_means_the_redirections_and_nothing_else() -> None:
    for code in ("MOVED 1 h:1", "ASK 1 h:1", "TRYAGAIN x", "CLUSTERDOWN x", "READONLY x"):
        assert not_here(err(code))
    assert not_here(err("LOADING x")) and not_here(err("MASTERDOWN x"))
    assert not not_here(err("WRONGTYPE x")) and not not_here(err("NOSCRIPT x"))
    assert not not_here(b"MOVED 1 h:1")  # a bulk string is a real reply
    assert len(NOT_HERE) == 7


def test_ask_target_reads_the_node_of_the_reply() -> None:
    assert ask_target(err("ASK 3999 127.0.0.1:6381"), HERE) == ("127.0.0.1", 6381)
    assert ask_target(err("ASK 3999 [::1]:6381"), HERE) == ("::1", 6381)
    assert ask_target(err("ASK 3999 :6381"), HERE) == ("10.0.0.1", 6381)
    assert ask_target(err("ASK 3999 ?:6381"), HERE) == ("10.0.0.1", 6381)
    assert ask_target(err("ASK 3999 :6381"), None) is None
    assert ask_target(err("ASK 3999 host:port"), HERE) is None
    assert ask_target(err("ASK 3999"), HERE) is None
    assert ask_target(err("MOVED 3999 127.0.0.1:6381"), HERE) is None


def test_a_pipeline_with_multi_is_a_transaction() -> None:
    assert is_transaction([("multi",), ("INCR", "a"), ("EXEC",)])
    assert is_transaction([(b"MULTI",)])
    assert not is_transaction([("INCR", "a"), ("GET", "multi"), ()])


def test_moved_reroutes_only_the_commands_not_run_here() -> None:
    moved = err("MOVED 12 10.0.0.2:7000")
    retry = Retry([("GET", "a"), ("GET", "b")], [b"1", moved], now=0.0, budget=1.0, here=HERE)
    step = retry.step(0.1)
    assert step == Resend([1], None, str(moved), moved)
    retry.record([1], [b"2"])
    assert retry.step(0.2) is None
    assert retry.replies == [b"1", b"2"]


def test_ask_goes_once_to_each_named_node_in_order() -> None:
    ask = err("ASK 1 h:1")
    replies = [ask, b"ok", err("ASK 1 h:2"), err("ASK 1 h:1")]
    retry = Retry([("GET", k) for k in "abcd"], replies, now=0.0, budget=1.0, here=HERE)
    assert retry.step(0.0) == Ask({("h", 1): [0, 3], ("h", 2): [2]}, ask)
    retry.record([0, 3], [b"a", b"d"])
    retry.record([2], [b"c"])
    assert retry.step(0.0) is None
    assert retry.replies == [b"a", b"ok", b"c", b"d"]


def test_an_unreadable_ask_is_raised() -> None:
    bad = err("ASK 1 nowhere")
    retry = Retry([("GET", "a")], [bad], now=0.0, budget=1.0, here=HERE)
    with pytest.raises(CommandError) as raised:
        retry.step(0.0)
    assert raised.value is bad


def test_tryagain_stays_and_backs_off_up_to_the_cap() -> None:
    retry = Retry([("MGET", "a", "b")], [err("TRYAGAIN x")], now=0.0, budget=60.0, here=HERE)
    delays = []
    for _ in range(8):
        step = retry.step(0.0)
        assert type(step) is Resend and step.indices == [0] and step.delay is not None
        delays.append(step.delay)
        retry.record([0], [err("TRYAGAIN x")])
    assert delays[:3] == [0.005, 0.01, 0.02]
    assert delays[-1] == BACKOFF_CAP and max(delays) == BACKOFF_CAP


def test_a_transaction_is_sent_again_whole_and_ask_in_it_waits_like_tryagain() -> None:
    commands = [("MULTI",), ("SET", "a", "1"), ("EXEC",)]
    replies = [b"OK", err("ASK 1 h:1"), err("EXECABORT x")]
    retry = Retry(commands, replies, now=0.0, budget=1.0, here=HERE)
    assert retry.todo() == [0, 1, 2]
    step = retry.step(0.0)
    assert type(step) is Resend and step.indices == [0, 1, 2]
    assert step.delay == 0.005 and step.first is None  # MULTI's OK is not an error
    retry.record([0, 1, 2], [b"OK", b"QUEUED", [b"OK"]])
    assert retry.step(0.0) is None


def test_a_mix_of_codes_reroutes() -> None:
    replies = [err("TRYAGAIN x"), err("READONLY y")]
    retry = Retry([("MULTI",), ("EXEC",)], replies, now=0.0, budget=1.0, here=HERE)
    step = retry.step(0.0)
    assert type(step) is Resend and step.delay is None and step.reason == "TRYAGAIN x"


def test_after_the_budget_the_errors_stay_with_a_note() -> None:
    loading = err("LOADING Redis is loading")
    retry = Retry([("GET", "a")], [loading], now=10.0, budget=0.5, here=HERE)
    assert type(retry.step(10.4)) is Resend
    assert retry.step(10.5) is None
    assert retry.replies == [loading]
    assert "after re-routing for reroute_timeout=0.5s" in " ".join(loading.__notes__)


def test_reroutes_close_together_wait_longer() -> None:
    streak, pause = reroute_pause(0, float("-inf"), 100.0)
    assert (streak, pause) == (0, 0.01)
    streak, pause = reroute_pause(streak, 100.0, 101.0)
    assert (streak, pause) == (1, 0.02)
    for _ in range(10):
        streak, pause = reroute_pause(streak, 101.0, 101.5)
    assert pause == 0.5
    assert reroute_pause(streak, 101.5, 103.6) == (0, 0.01)  # a new streak


def test_sentinel_poll_interval_is_a_quarter_of_the_budget_within_bounds() -> None:
    assert sentinel_poll_interval(2.0) == 0.5
    assert sentinel_poll_interval(0.0) == 0.05
    assert sentinel_poll_interval(60.0) == 1.0
