"""pdkv.integrations.sglang.aux without SGLang: decode's aux endpoint and prefill's sender
over loopback. A request's aux blobs reach ``on_aux`` only when their MAC verifies under the
pair's secret; what does not verify, or is not one message of the schema, is dropped and
its connection closed; a refusal by ``on_aux`` is counted and its connection kept. (The
endpoint's bounds on peers without the secret: test_endpoint.py and test_ports.py; the aux
path inside SGLang's classes: test_sglang.py.)"""

from __future__ import annotations

import hashlib
import hmac
import socket
import threading

import msgspec
import pytest
import zmq
from test_endpoint import _dealer
from test_transfer import wait_until
from zmq.utils.monitor import recv_monitor_message

from pdkv.errors import PdkvError
from pdkv.integrations.sglang import aux

SECRET = b"s" * 32
BLOBS = [bytes(range(64)), b"\x07" * 16]


class _Sink:
    """``on_aux``: records each call; answers ``why`` (a refusal) or raises when told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []
        self.why, self.boom = "", False
        self.lock = threading.Lock()

    def __call__(self, pid, blobs):
        with self.lock:
            self.calls.append((pid, blobs))
        if self.boom:
            raise RuntimeError("on_aux failed")
        return self.why


@pytest.fixture
def server():
    sink = _Sink()
    srv = aux.AuxServer("tcp://127.0.0.1:0", SECRET, sink, max_msg=aux.max_message([64, 16]))
    try:
        yield srv, sink
    finally:
        srv.close()


def _raw(addr: str, *frames: bytes) -> zmq.Socket:
    """A DEALER of its own sending ``frames`` as one message."""
    s = _dealer(addr)
    s.send_multipart(list(frames))
    return s


def _settled(srv: aux.AuxServer, written: int, dropped: int) -> None:
    wait_until(lambda: (srv.written, srv.dropped) == (written, dropped), 5, f"written {written}, dropped {dropped}")


def test_max_message_is_the_slots_bytes_and_framing_capped():
    assert aux.max_message([]) == 1024
    assert aux.max_message([64, 16]) == 64 + 16 + 1024 + 2 * 8
    assert aux.max_message(["100"]) == 100 + 1024 + 8  # anything int() takes
    assert aux.max_message([aux.MAX_AUX]) == aux.MAX_AUX
    assert aux.max_message([aux.MAX_AUX - 1024 - 8]) == aux.MAX_AUX
    assert aux.max_message([aux.MAX_AUX - 1024 - 9]) == aux.MAX_AUX - 1
    assert aux.MAX_AUX == 8 << 20


def test_the_mac_is_hmac_sha256_of_each_field_length_prefixed():
    """The wire format both sides of a pair compute (versions must agree on it)."""
    h = hmac.new(SECRET, b"pdkv-sglang-aux-1", hashlib.sha256)
    for p in (b"req-1", *BLOBS):
        h.update(len(p).to_bytes(8, "little") + p)
    assert aux._mac(SECRET, "req-1", BLOBS) == h.digest()
    # every field is bound, and bytes cannot move across a field's edge
    m = aux._mac(SECRET, "ab", [b"c"])
    assert m != aux._mac(SECRET, "a", [b"bc"])
    assert m != aux._mac(SECRET, "ab", [b"c", b""])
    assert m != aux._mac(b"t" * 32, "ab", [b"c"])


def test_a_verified_message_is_written_once_into_its_request(server):
    srv, sink = server
    tx = aux.AuxSender(SECRET)
    try:
        tx.send(srv.address, "req-1", BLOBS)
        _settled(srv, 1, 0)
        assert sink.calls == [("req-1", BLOBS)]
        tx.send(srv.address, "req-2", [b"", b"x"])
        _settled(srv, 2, 0)
        assert sink.calls[1] == ("req-2", [b"", b"x"])
        assert srv.connections == 1 and srv.pending == 0  # one connection, authenticated
    finally:
        tx.close()


def test_a_refusal_by_on_aux_is_counted_and_the_connection_kept(server):
    srv, sink = server
    sink.why = "no such request"
    tx = aux.AuxSender(SECRET)
    try:
        tx.send(srv.address, "gone", BLOBS)
        _settled(srv, 0, 1)
        assert sink.calls == [("gone", BLOBS)]
        sink.why = ""
        tx.send(srv.address, "req-3", BLOBS)
        _settled(srv, 1, 1)
        assert srv.connections == 1
    finally:
        tx.close()


def test_an_on_aux_that_raises_fails_that_message_alone(server):
    srv, sink = server
    sink.boom = True
    tx = aux.AuxSender(SECRET)
    try:
        tx.send(srv.address, "req-4", BLOBS)
        _settled(srv, 0, 1)
        sink.boom = False
        tx.send(srv.address, "req-5", BLOBS)
        _settled(srv, 1, 1)
    finally:
        tx.close()


def _msg(pid: str, blobs: list[bytes], mac: bytes = b"") -> bytes:
    return aux._enc.encode(aux.AuxMsg(pid, blobs, mac))


GOOD_MAC = aux._mac(SECRET, "req", BLOBS)
WELL_FORMED = {"pid": "req", "blobs": BLOBS, "mac": GOOD_MAC}


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param(lambda: [_msg("req", BLOBS, aux._mac(b"t" * 32, "req", BLOBS))], id="other-secret"),
        pytest.param(lambda: [_msg("req", BLOBS)], id="no-mac"),
        pytest.param(lambda: [_msg("req", [BLOBS[0]], GOOD_MAC)], id="blob-cut"),
        pytest.param(lambda: [_msg("rex", BLOBS, GOOD_MAC)], id="other-pid"),
        pytest.param(lambda: [b"\xc1not msgpack"], id="malformed"),
        pytest.param(lambda: [msgspec.msgpack.encode({**WELL_FORMED, "x": 1})], id="unknown-field"),
        pytest.param(lambda: [msgspec.msgpack.encode({"pid": 7, "blobs": BLOBS})], id="wrong-type"),
        pytest.param(lambda: [_msg("req", BLOBS, GOOD_MAC), b""], id="two-parts"),
    ],
)
def test_what_does_not_verify_is_dropped_and_its_connection_closed(server, frames):
    srv, sink = server
    s = _raw(srv.address, *frames())
    try:
        _settled(srv, 0, 1)
        wait_until(lambda: srv.connections == 0, 5, "the connection closed")
        assert sink.calls == []
    finally:
        s.close(0)
    # the endpoint serves the next peer
    tx = aux.AuxSender(SECRET)
    try:
        tx.send(srv.address, "req", BLOBS)
        _settled(srv, 1, 1)
    finally:
        tx.close()


def test_a_message_over_the_slots_size_ends_its_connection_unread(server):
    srv, sink = server
    big = [b"\x00" * (srv.max_msg + 1)]
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    mon.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        s.connect(srv.address)
        s.send(aux._enc.encode(aux.AuxMsg("req", big, aux._mac(SECRET, "req", big))))
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED  # the endpoint hung up
        assert sink.calls == [] and srv.written == 0 and srv.dropped == 0  # never read
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)


def test_the_sender_keeps_one_socket_a_decode_and_never_blocks():
    """Sends to a decode that is not there queue up to the socket's bound and then fail at
    once, naming the request and the address."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{probe.getsockname()[1]}"  # bound, never listening
        tx = aux.AuxSender(SECRET)
        try:
            tx.send(dead, "req-0", [b"x"])
            tx.send(dead, "req-0b", [b"x"])
            assert list(tx._socks) == [dead]
            s = tx._socks[dead]
            assert s.getsockopt(zmq.SNDHWM) == 1024 and s.getsockopt(zmq.LINGER) == 1000
            assert s.type == zmq.DEALER
            with pytest.raises(PdkvError, match=rf"aux for 'req-\d+' not sent to {dead}"):
                for i in range(1, 20000):
                    tx.send(dead, f"req-{i}", [b"x"])
            assert i > 1000  # the queue held about SNDHWM messages first
        finally:
            tx.close()
    assert tx._socks == {} and s.closed and tx._ctx.closed


def test_a_bad_bind_names_the_endpoint():
    with pytest.raises(PdkvError, match="aux endpoint tcp://256.0.0.1:1"):
        aux.AuxServer("tcp://256.0.0.1:1", SECRET, _Sink())
