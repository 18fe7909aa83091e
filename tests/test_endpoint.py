"""pdkv.integrations.core.endpoint: the bounds a RouterEndpoint puts on peers without the
secret, and its loop, in which one bad message or connection fails alone. The pull and aux
endpoints are RouterEndpoints; their own tests (test_pull.py, test_ports.py) try them whole."""

from __future__ import annotations

import math
import socket
import threading
import time

import pytest
import zmq
from test_transfer import wait_until

from pdkv.errors import PdkvError
from pdkv.integrations.core.endpoint import Limits, RouterEndpoint


class _Echo(RouterEndpoint):
    """``ok`` authenticates and is served (answered ``ok``); ``refuse`` authenticates and
    is refused; ``bad`` does not authenticate; ``boom`` raises in ``_serve``."""

    def __init__(self, bind="tcp://127.0.0.1:0", *, start=True, **kw):
        kw.setdefault("max_msg", 1024)
        super().__init__(bind, what="test endpoint", thread_name="pdkv-test-endpoint", **kw)
        self.served: list[list[bytes]] = []
        self.lock = threading.Lock()
        if start:
            self._start()

    def _serve(self, frames):
        with self.lock:
            self.served.append(frames[1:])
        word = frames[1]
        if word == b"boom":
            raise RuntimeError("boom")
        if word == b"bad":
            return False, "bad mac"
        if word == b"refuse":
            return True, "refused"
        self._sock.send_multipart([frames[0], b"ok"])
        return True, ""


def _dealer(addr):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 3000)
    s.connect(addr)
    return s


def _port(addr):
    return int(addr.rsplit(":", 1)[1])


def _closed(raw, wait=0.5):
    """Whether the endpoint closed this raw connection (zmq's greeting read and dropped)."""
    raw.settimeout(wait)
    try:
        while raw.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


@pytest.mark.parametrize(
    "kw",
    [
        {"max_pending": 0},
        {"max_pending": -1},
        {"max_pending": True},
        {"max_pending": 2.0},
        {"max_per_source": 0},
        {"max_per_source": False},
        {"max_per_source": "8"},
        {"rcvhwm": 0},
        {"rcvhwm": True},
        {"rcvhwm": None},
    ],
)
def test_limits_refuse_a_count_that_is_not_a_positive_integer_by_name(kw):
    ((name, v),) = kw.items()
    with pytest.raises(ValueError) as e:
        Limits(**kw)
    assert str(e.value) == f"{name}={v!r} must be a positive integer"


@pytest.mark.parametrize("t", [0, 0.0, -1.0, math.nan])
def test_limits_refuse_an_auth_timeout_that_is_not_positive(t):
    with pytest.raises(ValueError) as e:
        Limits(auth_timeout_s=t)
    assert str(e.value) == f"auth_timeout_s={t!r} must be positive"


def test_limits_hold_what_they_were_given_and_bound_the_bytes_queued():
    d = Limits()
    assert (d.auth_timeout_s, d.max_pending, d.max_per_source, d.rcvhwm) == (5.0, 32, 8, 4)
    assert d.bytes_bound(1000) == 32 * 4 * 1000
    x = Limits(auth_timeout_s=1, max_pending=3, max_per_source=1, rcvhwm=2)
    assert type(x.auth_timeout_s) is float and x.auth_timeout_s == 1.0
    assert (x.max_pending, x.max_per_source, x.rcvhwm) == (3, 1, 2)
    assert x.bytes_bound(7) == 3 * 2 * 7


def test_the_socket_carries_the_limits():
    ep = _Echo(max_msg=4096, limits=Limits(rcvhwm=3))
    try:
        assert ep._sock.getsockopt(zmq.MAXMSGSIZE) == 4096 and ep.max_msg == 4096
        assert ep._sock.getsockopt(zmq.RCVHWM) == 3
        assert ep._sock.getsockopt(zmq.LINGER) == 0
        assert ep.address.startswith("tcp://127.0.0.1:") and _port(ep.address) > 0
        assert ep.limits.rcvhwm == 3 and ep.limits.max_pending == Limits().max_pending
    finally:
        ep.close()


def test_a_port_in_use_is_named_and_nothing_is_left_open():
    ep = _Echo()
    try:
        threads = threading.active_count()
        with pytest.raises(PdkvError) as e:
            _Echo(ep.address)
        assert str(e.value).startswith(f"test endpoint {ep.address}: ")
        assert threading.active_count() == threads  # the guard's monitor went with the socket
    finally:
        ep.close()


def test_a_message_that_verifies_is_served_and_its_connection_kept():
    ep = _Echo()
    d = _dealer(ep.address)
    try:
        d.send_multipart([b"ok", b"x"])
        assert d.recv() == b"ok"
        assert ep.served == [[b"ok", b"x"]] and ep.dropped == 0
        wait_until(lambda: (ep.connections, ep.pending) == (1, 0), 5, "one authenticated connection")
        d.send(b"ok")  # the same connection, served again
        assert d.recv() == b"ok" and len(ep.served) == 2
    finally:
        d.close()
        ep.close()


def test_nothing_is_served_before_the_subclass_starts_the_loop():
    ep = _Echo(start=False)
    d = _dealer(ep.address)
    try:
        d.send(b"ok")
        time.sleep(0.3)
        assert ep.served == []
        ep._start()
        assert d.recv() == b"ok" and ep.served == [[b"ok"]]
    finally:
        d.close()
        ep.close()


def test_a_message_that_does_not_verify_closes_its_connection_alone():
    ep = _Echo()
    good, bad = _dealer(ep.address), _dealer(ep.address)
    try:
        good.send(b"ok")
        assert good.recv() == b"ok"
        bad.send(b"bad")
        wait_until(lambda: ep.dropped == 1, 5, "one message dropped")
        wait_until(lambda: ep.connections == 1, 5, "the bad connection gone")
        assert ep.counts == {"control_evicted": 1}
        good.send(b"ok")  # the good one still is served
        assert good.recv() == b"ok"
        assert ep.dropped == 1 and ep.pending == 0
    finally:
        good.close()
        bad.close()
        ep.close()


@pytest.mark.parametrize("word", [b"boom", b"refuse"])
def test_a_message_whose_serving_raises_or_refuses_fails_alone_and_keeps_its_connection(word):
    """``_serve`` raising (logged) or refusing an authenticated message: counted as dropped,
    the connection and the loop live on."""
    ep = _Echo()
    d = _dealer(ep.address)
    try:
        d.send(word)
        wait_until(lambda: ep.dropped == 1, 5, "one message dropped")
        wait_until(lambda: (ep.connections, ep.pending) == (1, 0), 5, "one authenticated connection")
        d.send(b"ok")
        assert d.recv() == b"ok" and ep.dropped == 1
    finally:
        d.close()
        ep.close()


def test_a_message_over_the_cap_ends_its_connection_unread():
    ep = _Echo(max_msg=1024)
    big, d = _dealer(ep.address), _dealer(ep.address)
    try:
        big.send(b"o" * 1025)
        d.send(b"ok")
        assert d.recv() == b"ok"
        wait_until(lambda: ep.connections == 1, 5, "the oversized connection gone")
        assert ep.served == [[b"ok"]]
    finally:
        big.close()
        d.close()
        ep.close()


def test_a_connection_that_never_authenticates_is_closed_at_its_deadline():
    ep = _Echo(limits=Limits(auth_timeout_s=0.3))
    raw = socket.create_connection(("127.0.0.1", _port(ep.address)))
    try:
        wait_until(lambda: ep.pending == 1, 5, "one pending connection")
        t0 = time.monotonic()
        wait_until(lambda: ep.connections == 0, 3, "the pending connection closed")
        assert time.monotonic() - t0 < 2.0
        assert _closed(raw) and ep.counts == {"control_evicted": 1}
    finally:
        raw.close()
        ep.close()


@pytest.mark.parametrize("cap", ["max_pending", "max_per_source"])
def test_pending_connections_beyond_a_cap_are_closed_oldest_first(cap):
    ep = _Echo(limits=Limits(**{cap: 2}))
    raws = []
    try:
        for _ in range(5):
            raws.append(socket.create_connection(("127.0.0.1", _port(ep.address))))
            time.sleep(0.05)
        wait_until(lambda: ep.pending == 2, 5, "two pending connections left")
        time.sleep(0.3)
        assert ep.pending == 2 and ep.connections == 2
        assert ep.counts == {"control_evicted": 3}
        assert [_closed(r) for r in raws] == [True, True, True, False, False]  # the oldest went
        d = _dealer(ep.address)  # a peer with the secret still gets in
        try:
            d.send(b"ok")
            assert d.recv() == b"ok"
        finally:
            d.close()
    finally:
        for r in raws:
            r.close()
        ep.close()


def test_close_ends_the_thread_and_frees_the_port():
    ep = _Echo()
    addr = ep.address
    ep.close()
    assert not ep._thread.is_alive()
    again = _Echo(addr)  # the port is free at once (LINGER 0)
    again.close()


def test_close_of_an_endpoint_never_started_returns():
    ep = _Echo(start=False)
    t0 = time.monotonic()
    ep.close()
    assert time.monotonic() - t0 < 1.0
