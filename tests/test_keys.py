"""mesh._keys: the key and channel names of a namespace and the names that
become part of them. Pure: no Redis (the protocol tests use the keys)."""

from __future__ import annotations

import hashlib

import pytest

import mesh
from mesh._errors import ConfigError
from mesh._keys import PROTOCOL_VERSION, Keys, check_queue, check_worker_id
from mesh._topology import keyslot


def test_every_key_of_a_namespace_shares_one_cluster_slot() -> None:
    k = Keys("ns1")
    q, w = "jobs:eu/1", "host-1.a_b"
    names = [
        k.token, k.queues, k.workers, k.info, k.version, k.policy, k.schedules,
        k.schedule_specs, k.queue(q), k.persistent(q), k.idle(q), k.moving(q),
        k.reserved(q), k.unowned(q), k.share(q), k.standby(q), k.procs(q), k.attempts(q),
        k.delayed(q), k.prio(q), k.delayed_prio(q), k.dead(q), k.result(q, b"p"), k.rate(q),
        k.servers(q), k.heartbeat(w), k.serves(w), k.inbox(w), k.held(w, q),
        k.wake_channel(w), k.done_channel(q), k.delete_channel(q), k.cancel_channel(w),
    ]  # fmt: skip
    assert all(n.startswith("{ns1}:") for n in names)
    assert len(set(names)) == len(names)  # no two the same
    assert {keyslot(n) for n in names} == {mesh.namespace_slot("ns1")}


def test_a_queue_name_is_the_last_part_and_no_two_names_collide() -> None:
    k = Keys("ns")
    assert k.queue("a:b") == "{ns}:queue:a:b"
    assert k.held("w1", "a:b") == "{ns}:held:w1:a:b"
    # the same string for two (worker, queue) pairs, but a worker id holds
    # no ':', so only one of them can exist
    assert k.held("w1", "x:q") == k.held("w1:x", "q")
    with pytest.raises(ConfigError):
        check_worker_id("w1:x")
    assert k.wake_channel("w1") == k.wake_prefix + "w1"
    assert k.cancel_channel("w1") == k.cancel_prefix + "w1"


def test_the_result_key_names_the_payload_by_its_sha1() -> None:
    k = Keys("ns")
    payload = b"\x00\xff a payload"
    assert k.result("q", payload) == f"{{ns}}:result:{hashlib.sha1(payload).hexdigest()}:q"
    assert k.result("q", b"a") != k.result("q", b"b")


def test_parse_heartbeat_key() -> None:
    k = Keys("ns")
    assert k.parse_heartbeat_key(k.heartbeat("w-1").encode()) == "w-1"
    assert k.parse_heartbeat_key(b"{other}:worker:w-1") is None
    assert k.parse_heartbeat_key(k.serves("w-1").encode()) is None


@pytest.mark.parametrize("good", ["a", "jobs", "A-Z_0.9:/@+=-", "x" * 200])
def test_valid_queue_names(good: str) -> None:
    assert check_queue(good) == good


@pytest.mark.parametrize("bad", ["", "a b", "{a}", "a*", "a?", "a\n", "é", "x" * 201])
def test_invalid_queue_names_are_one_config_error(bad: str) -> None:
    with pytest.raises(ConfigError) as exc:
        check_queue(bad)
    assert str(exc.value) == (
        f"invalid queue name {bad!r}: use 1 to 200 of the characters A-Z a-z 0-9 _ . : / @ + = -"
    )


def test_names_that_are_not_str_are_type_errors() -> None:
    with pytest.raises(TypeError, match=r"^queue name must be a str, not bytes$"):
        check_queue(b"q")
    with pytest.raises(TypeError, match=r"^worker id must be a str, not int$"):
        check_worker_id(3)
    with pytest.raises(TypeError, match=r"^namespace must be a str, not NoneType$"):
        Keys(None)  # type: ignore[arg-type]


def test_worker_ids_and_namespaces() -> None:
    assert check_worker_id("host-12.a_b") == "host-12.a_b"
    assert check_worker_id("x" * 128) == "x" * 128
    for bad in ("", "a:b", "a b", "x" * 129):
        with pytest.raises(ConfigError, match=r"^invalid worker id"):
            check_worker_id(bad)
    assert Keys("x" * 64).prefix == "{" + "x" * 64 + "}:"
    for bad in ("", "a:b", "{a}", "x" * 65):
        with pytest.raises(ConfigError, match=r"^invalid namespace"):
            Keys(bad)


def test_the_protocol_version_is_a_whole_number() -> None:
    assert PROTOCOL_VERSION.isdigit() and int(PROTOCOL_VERSION) >= 7
