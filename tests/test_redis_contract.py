"""Contract tests for the parts of redis-py and hiredis that mesh._connection uses.

We use redis-py only for its sans-IO pieces (command packing, value encoding, an
exception class) and hiredis for reply parsing. An upgrade that changes any of the
behaviours below must fail here, loudly, before it corrupts bytes on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import hiredis
import pytest
import redis
import redis.connection
from redis._parsers import Encoder
from redis.exceptions import DataError

from mesh._errors import CommandError, ConfigError
from mesh._transport import ENCODER as _ENCODER
from mesh._transport import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
from mesh._transport import make_reader as _make_reader
from mesh._transport import pack as _pack

encode = cast(Callable[[object], Any], _ENCODER.encode)


def test_versions_pinned() -> None:
    assert redis.__version__.split(".")[0] == "8"
    assert hiredis.__version__.split(".")[0] == "3"


def test_encoder_is_the_one_redis_connection_uses() -> None:
    assert redis.connection.Encoder is Encoder  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (b"", b""),
        (b"\x00\xff", b"\x00\xff"),
        ("é", "é".encode()),
        (0, b"0"),
        (-12, b"-12"),
        (2**70, str(2**70).encode()),
        (1.5, b"1.5"),
        (0.1, b"0.1"),  # repr, not str(): shortest round-tripping form
        (1e300, b"1e+300"),
    ],
)
def test_encoder_encode(value: object, encoded: bytes) -> None:
    assert encode(value) == encoded


def test_encoder_passes_bytes_through_unchanged() -> None:
    data = b"payload"
    assert encode(data) is data
    view = memoryview(b"abc")
    assert encode(view) is view


@pytest.mark.parametrize("bad", [True, False, None, [1], {"a": 1}, object()])
def test_encoder_rejects_other_types(bad: object) -> None:
    with pytest.raises(DataError):
        encode(bad)


def test_pack_writes_exact_resp() -> None:
    # mesh._connection packs RESP itself (test_connection pins it against
    # redis-py's PythonRespSerializer); redis-py's Encoder above does the rest.
    assert b"".join(_pack(("SET", b"k", b""))) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n"
    assert b"".join(_pack(("ECHO", b"\x00\r\n"))) == b"*2\r\n$4\r\nECHO\r\n$3\r\n\x00\r\n\r\n"
    assert b"".join(_pack((b"INCRBY", "k", 7))) == b"*3\r\n$6\r\nINCRBY\r\n$1\r\nk\r\n$1\r\n7\r\n"
    assert b"".join(_pack(("PING",))) == b"*1\r\n$4\r\nPING\r\n"


def test_serializer_splits_only_the_command_name() -> None:
    assert b"".join(_pack(("CONFIG GET", "a b"))) == (
        b"*3\r\n$6\r\nCONFIG\r\n$3\r\nGET\r\n$3\r\na b\r\n"
    )
    assert b"".join(_pack((b"CLIENT SETNAME", b"x"))) == (
        b"*3\r\n$6\r\nCLIENT\r\n$7\r\nSETNAME\r\n$1\r\nx\r\n"
    )


def test_serializer_large_values_are_separate_chunks() -> None:
    big = bytes(range(256)) * 40  # 10240 bytes > buffer_cutoff
    chunks = _pack(("SET", b"k", big))
    assert any(chunk is big for chunk in chunks)  # not copied
    assert b"".join(chunks) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$10240\r\n" + big + b"\r\n"


def test_our_pack_maps_data_error() -> None:
    assert b"".join(_pack(("GET", b"k"))) == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    with pytest.raises(ConfigError, match="bool"):
        _pack(("SET", b"k", True))


def test_hiredis_reader_replies() -> None:
    reader = _make_reader()
    reader.feed(b"+OK\r\n:-5\r\n$0\r\n\r\n$-1\r\n*-1\r\n*2\r\n$1\r\n\x00\r\n*0\r\n")
    assert reader.gets() == b"OK"
    assert reader.gets() == -5
    assert reader.gets() == b""
    assert reader.gets() is None
    assert reader.gets() is None
    assert reader.gets() == [b"\x00", []]
    assert reader.gets() is _NOT_ENOUGH_DATA


def test_hiredis_reader_partial_feeds() -> None:
    reader = _make_reader()
    wire = b"$5\r\nab\r\nc\r\n"
    for byte in wire[:-1]:
        reader.feed(bytes([byte]))
        assert reader.gets() is _NOT_ENOUGH_DATA
    reader.feed(wire[-1:])
    assert reader.gets() == b"ab\r\nc"


def test_hiredis_error_replies_use_callback() -> None:
    reader = _make_reader()
    reader.feed(b"-WRONGTYPE Operation against a key\r\n*2\r\n-ERR inner\r\n:1\r\n-\r\n")
    top = reader.gets()
    assert isinstance(top, CommandError)
    assert top.code == "WRONGTYPE"
    assert str(top) == "WRONGTYPE Operation against a key"
    nested = reader.gets()
    assert isinstance(nested[0], CommandError)
    assert nested[0].code == "ERR"
    assert nested[1] == 1
    empty = reader.gets()
    assert isinstance(empty, CommandError)
    assert empty.code == ""


def test_hiredis_error_reply_bad_utf8_does_not_raise() -> None:
    reader = _make_reader()
    reader.feed(b"-ERR \xff\xfe\r\n")
    reply = reader.gets()
    assert isinstance(reply, CommandError)
    assert reply.code == "ERR"


def test_hiredis_protocol_error() -> None:
    reader = _make_reader()
    reader.feed(b"?nonsense\r\n")
    with pytest.raises(hiredis.ProtocolError):
        reader.gets()


def test_pack_reuses_pieces_of_repeated_arguments_without_mixing_types() -> None:
    """The packer keeps the pieces of recent str and int arguments: the bytes
    are the same on every call, and a value equal to a cached one but of
    another type (True == 1, 1.0 == 1) is packed (or refused) as its own."""
    for _ in range(3):
        assert b"".join(_pack(("SET", "k", 1))) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n1\r\n"
    assert b"".join(_pack(("SET", "k", 1.0))) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\n1.0\r\n"
    assert b"".join(_pack(("SET", "1", b"1"))) == b"*3\r\n$3\r\nSET\r\n$1\r\n1\r\n$1\r\n1\r\n"
    with pytest.raises(ConfigError, match="bool"):
        _pack(("SET", "k", True))
    long = "é" * 200  # longer than what is kept: packed each time
    for _ in range(2):
        assert b"".join(_pack(("ECHO", long))) == b"*2\r\n$4\r\nECHO\r\n$400\r\n" + (
            long.encode() + b"\r\n"
        )


def test_pack_piece_cache_stays_bounded() -> None:
    from mesh import _transport

    for i in range(3 * _transport._PIECES_MAX):
        assert b"".join(_pack(("GET", f"key:{i}"))) == b"*2\r\n$3\r\nGET\r\n$%d\r\nkey:%d\r\n" % (
            len(f"key:{i}"),
            i,
        )
        assert len(_transport._PIECES) <= _transport._PIECES_MAX
    assert all(len(piece) <= _transport._PIECE_MAX + 10 for piece in _transport._PIECES.values())


def test_packed_command_is_its_arguments_packed_once() -> None:
    from mesh._transport import Packed

    args = ("EVALSHA", "ab" * 20, 2, "{ns}:a", "{ns}:b", b"\x00payload", 7, 0.5)
    packed = Packed(args)
    assert packed == args and isinstance(packed, tuple)
    assert packed[0] == "EVALSHA" and len(packed) == len(args)
    assert _pack(packed) == [b"".join(_pack(args))]
    assert Packed(("CLIENT KILL", "ID", 3)).resp == b"".join(_pack(("CLIENT", "KILL", "ID", 3)))
    with pytest.raises(ConfigError, match="bool"):
        Packed(("SET", "k", True))
