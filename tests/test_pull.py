"""The pull endpoint (pdkv.integrations.core.pull): decode asks prefill, prefill answers; what
is malformed, unauthenticated or too long changes nothing and stops nothing."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import zmq

from pdkv.integrations.core.pull import MAX_MSG, PullClient, PullReq, PullServer

B = b"b" * 32


def _wait(res, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not res.done and time.monotonic() < deadline:
        time.sleep(0.002)
    return res


class _Prefill:
    """What a prefill's on_pull sees and answers."""

    def __init__(self, answer=""):
        self.seen: list[PullReq] = []
        self.answer = answer

    def __call__(self, r: PullReq) -> str:
        self.seen.append(r)
        return self.answer


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_a_pull_reaches_prefill_and_its_answer_comes_back(secret):
    p = _Prefill()
    srv = PullServer("tcp://127.0.0.1:0", p, secret=secret)
    cli = PullClient((srv.address,), secret=secret)
    try:
        res = _wait(cli.pull(srv.address, "px.1", B, "tcp://127.0.0.1:9"))
        assert res.done and res.error == ""
        assert [(r.pid, r.binding, r.decode) for r in p.seen] == [("px.1", B, "tcp://127.0.0.1:9")]
        p.answer = "not held here"
        res = _wait(cli.pull(srv.address, "px.2", B, "tcp://127.0.0.1:9"))
        assert res.error == "not held here" and (srv.served, srv.refused) == (1, 1)
    finally:
        cli.close()
        srv.close()


def test_a_pulls_prefix_reaches_prefill_under_the_mac_and_zero_is_not_on_the_wire():
    """``prefix`` (tokens decode holds already) arrives as sent; a prefix changed on the
    way fails the MAC (no answer); a pull without one encodes as before the field existed."""
    p = _Prefill()
    srv = PullServer("tcp://127.0.0.1:0", p, secret=b"s")
    cli = PullClient((srv.address,), secret=b"s", timeout_s=0.5)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(srv.address)
    try:
        assert _wait(cli.pull(srv.address, "px.1", B, "tcp://127.0.0.1:9", prefix=48)).error == ""
        assert [r.prefix for r in p.seen] == [48]
        # what the client signed for prefix 48, sent with prefix 16
        signed = msgspec.structs.replace(p.seen[0], nonce=b"m" * 16)
        from pdkv.integrations.core import pull as pull_mod

        signed = msgspec.structs.replace(signed, mac=pull_mod._req_mac(b"s", signed))
        raw.send(msgspec.msgpack.encode(msgspec.structs.replace(signed, prefix=16)))
        assert not raw.poll(500) and len(p.seen) == 1
        raw.send(msgspec.msgpack.encode(signed))  # the same, untouched: served
        assert raw.poll(2000) and len(p.seen) == 2
        plain = msgspec.msgpack.decode(msgspec.msgpack.encode(PullReq(pid="x", binding=B, decode="d", nonce=B[:16])))
        assert "prefix" not in plain
    finally:
        raw.close(linger=0)
        cli.close()
        srv.close()


def test_a_pull_without_the_secret_is_unanswered_and_times_out():
    p = _Prefill()
    srv = PullServer("tcp://127.0.0.1:0", p, secret=b"right")
    cli = PullClient((srv.address,), secret=b"wrong", timeout_s=0.5)
    none = PullClient((srv.address,), secret=None, timeout_s=0.5)
    try:
        for c in (cli, none):
            res = _wait(c.pull(srv.address, "px.1", B, "tcp://127.0.0.1:9"))
            assert res.done and "no answer from prefill within 0.5 s" in res.error
        assert p.seen == [] and srv.dropped == 2
    finally:
        none.close()
        cli.close()
        srv.close()


def test_an_address_not_configured_is_never_connected_to():
    cli = PullClient(("tcp://127.0.0.1:1",))
    try:
        res = cli.pull("tcp://127.0.0.1:2", "px.1", B, "tcp://127.0.0.1:9")
        assert res.done and res.error == "'tcp://127.0.0.1:2' is not a configured prefill"
        assert cli._socks == {}
    finally:
        cli.close()


def test_a_prefill_that_never_answers_fails_the_pull_within_its_timeout():
    cli = PullClient(("tcp://127.0.0.1:1",), timeout_s=0.3)  # nothing listens there
    try:
        t0 = time.monotonic()
        res = _wait(cli.pull("tcp://127.0.0.1:1", "px.1", B, "tcp://127.0.0.1:9"))
        assert res.done and "no answer" in res.error and time.monotonic() - t0 < 2
    finally:
        cli.close()


@pytest.mark.parametrize("seed", range(5))
def test_random_bytes_and_bad_fields_change_nothing_and_stop_nothing(seed):
    """Random bytes, an oversized message, wrong field types and out-of-range fields: no
    call of on_pull, and a good pull is answered afterwards."""
    p = _Prefill()
    srv = PullServer("tcp://127.0.0.1:0", p)
    ctx = zmq.Context.instance()
    socks: list[zmq.Socket] = []

    def connect() -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(srv.address)
        socks.append(s)
        return s

    enc = msgspec.msgpack.encode
    bad = [
        os.urandom(64 + seed * 97),
        enc({"pid": 1, "binding": B, "decode": "d", "nonce": b"n" * 16}),
        enc({"pid": "x", "binding": B, "decode": "d", "nonce": b"n" * 16, "extra": 1}),
        enc(PullReq(pid="x", binding=b"short", decode="d", nonce=b"n" * 16)),  # answered: refused by its fields
        enc(PullReq(pid="a\nb", binding=B, decode="d", nonce=b"n" * 16)),
        enc(PullReq(pid="x", binding=B, decode="d", nonce=b"n")),
        enc(PullReq(pid="x", binding=B, decode="d", nonce=b"n" * 16, prefix=-1)),
        enc(PullReq(pid="x", binding=B, decode="d", nonce=b"n" * 16, prefix=1 << 31)),
    ]
    try:
        # each on a connection of its own: a malformed message closes the connection it came on
        for m in bad:
            connect().send(m)
        connect().send_multipart([b"two", b"frames"])
        connect().send(b"\x00" * (MAX_MSG + 1))  # zmq drops the connection of a peer past MAXMSGSIZE
        deadline = time.monotonic() + 5
        while srv.refused < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        cli = PullClient((srv.address,))
        try:
            res = _wait(cli.pull(srv.address, "px.ok", B, "tcp://127.0.0.1:9"))
            assert res.error == ""
        finally:
            cli.close()
        assert [r.pid for r in p.seen] == ["px.ok"]
        assert srv.refused == 5  # the five well-formed ones with bad fields were answered "no"
    finally:
        for sock in socks:
            sock.close(linger=0)
        srv.close()


def test_a_vllm_prefills_desk_refuses_a_pull_that_asks_for_part_of_a_request():
    """PullDesk (vLLM's prefill) sends a held request whole: a pull naming a prefix is
    refused and the request stays held for a pull that asks for all of it."""
    from pdkv.integrations.core.pull import Held, PullDesk

    desk = PullDesk(("tcp://d:1",))
    desk.hold(Held("r", "p1", 32, (1, 2), B, deadline=1e18))
    part = PullReq(pid="p1", binding=B, decode="tcp://d:1", nonce=b"n" * 16, prefix=16)
    assert "whole" in desk.on_pull(part)
    assert desk.on_pull(msgspec.structs.replace(part, prefix=0)) == ""
    pulled, gone = desk.take(0.0)
    assert [(h.pid, d) for h, d in pulled] == [("p1", "tcp://d:1")] and gone == []
