"""pdkv.integrations.sglang.bootstrap without SGLang: the signed table of a prefill
instance's ranks, its HTTP server and clients over loopback. The server stores an entry only
when it verifies under the pair's secret, is fresh by the server's clock and newer than the
rank's stored one; decode uses only entries that verify and are fresh, all ranks of one TP
size. (Replays and a lost table healing: test_ports.py; inside SGLang: test_sglang.py.)"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import http.client
import http.server
import json
import socket
import threading
import urllib.error
import urllib.request

import pytest
from test_transfer import wait_until

from pdkv import KVLayout
from pdkv.errors import PdkvError
from pdkv.integrations.sglang import bootstrap as b

SECRET = b"k" * 32
LAY = KVLayout(num_layers=2, kv_heads=2, head_dim=8, tokens_per_block=4, dtype="bf16", token_major=True)
DESK = "tcp://127.0.0.1:7000"
FIELDS = "an entry has exactly the fields rank, tp_size, desk, layout, instance, issued, mac"
BAD_MAC = "the entry's MAC does not verify (wrong or missing secret)"
BAD_RANK = "rank must be in [0, tp_size)"
BAD_DESK = "desk must be a tcp:// address"
BAD_ISSUED = "issued must be milliseconds"


def _lay(rank: int, tp: int = 2) -> KVLayout:
    return dataclasses.replace(LAY, tp_rank=rank, tp_size=tp)


def _resigned(e: dict, **changes) -> dict:
    """``e`` with ``changes``, signed again (a peer with the secret sending a bad field)."""
    e = {**e, **changes}
    e["mac"] = b._mac(SECRET, e)
    return e


@pytest.fixture
def srv():
    s = b.BootstrapServer("127.0.0.1", 0, SECRET)
    try:
        yield s
    finally:
        s.close()


def _call(port: int, method: str, path: str = "/pdkv/ranks", body: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


# ---------------------------------------------------------------------- entries


def test_an_entry_carries_the_ranks_fields_signed():
    t0 = b._now_ms()
    e = b.entry_for(SECRET, _lay(1), DESK, "inst-a")
    assert set(e) == {"rank", "tp_size", "desk", "layout", "instance", "issued", "mac"}
    assert (e["rank"], e["tp_size"], e["desk"], e["instance"]) == (1, 2, DESK, "inst-a")
    assert e["layout"] == dataclasses.asdict(_lay(1)) and b.layout_of(e) == _lay(1)
    assert t0 <= e["issued"] <= b._now_ms()
    assert b.entry_for(SECRET, _lay(1), DESK, "inst-a", issued=12.9)["issued"] == 12
    # the MAC: HMAC-SHA256 of the fields, sorted, compact JSON, under a domain label
    body = json.dumps({k: e[k] for k in b._FIELDS}, sort_keys=True, separators=(",", ":")).encode()
    assert e["mac"] == hmac.new(SECRET, b"pdkv-sglang-bootstrap-2" + body, hashlib.sha256).hexdigest()
    assert b.check_entry(SECRET, e) == ""


@pytest.mark.parametrize(
    "bad, why",
    [
        (lambda e: [e], FIELDS),
        (lambda e: {k: v for k, v in e.items() if k != "issued"}, FIELDS),
        (lambda e: {**e, "extra": 1}, FIELDS),
        (lambda e: {**e, "mac": e["mac"][:-1] + ("1" if e["mac"].endswith("0") else "0")}, BAD_MAC),
        (lambda e: {**e, "mac": 7}, BAD_MAC),
        (lambda e: {**e, "desk": "tcp://127.0.0.1:6666"}, BAD_MAC),  # a field changed
        (lambda e: {**e, "mac": b._mac(b"x" * 32, e)}, BAD_MAC),  # another secret
        (lambda e: _resigned(e, rank="0"), BAD_RANK),
        (lambda e: _resigned(e, rank=-1), BAD_RANK),
        (lambda e: _resigned(e, rank=2), BAD_RANK),
        (lambda e: _resigned(e, tp_size=2.0), BAD_RANK),
        (lambda e: _resigned(e, desk=7), BAD_DESK),
        (lambda e: _resigned(e, desk="ipc:///tmp/x"), BAD_DESK),
        (lambda e: _resigned(e, desk="tcp://" + "a" * 251), BAD_DESK),
        (lambda e: _resigned(e, issued="1"), BAD_ISSUED),
        (lambda e: _resigned(e, issued=True), BAD_ISSUED),
        (lambda e: _resigned(e, issued=1.5), BAD_ISSUED),
    ],
)
def test_a_bad_entry_is_named(bad, why):
    e = bad(b.entry_for(SECRET, _lay(1), DESK, "p"))
    assert b.check_entry(SECRET, e) == why


def test_the_longest_desk_and_the_last_rank_are_good():
    e = b.entry_for(SECRET, _lay(1), "tcp://" + "a" * 250, "p")
    assert len(e["desk"]) == 256 and b.check_entry(SECRET, e) == ""
    assert b.check_entry(SECRET, _resigned(e, rank=0)) == ""


def test_a_layout_that_is_not_pdkvs_names_the_rank():
    e = b.entry_for(SECRET, _lay(1), DESK, "p")
    for layout in ({**e["layout"], "nope": 1}, {**e["layout"], "num_layers": 0}):
        with pytest.raises(PdkvError, match="prefill rank 1: its layout is not a pdkv layout"):
            b.layout_of({**e, "layout": layout})


# ---------------------------------------------------------------------- the server


def test_the_server_stores_verified_entries_and_serves_the_table(srv):
    assert _call(srv.port, "GET") == (200, {"ranks": {}})
    assert srv.address == f"127.0.0.1:{srv.port}"
    entries = [b.entry_for(SECRET, _lay(r), f"tcp://127.0.0.1:{7000 + r}", "p") for r in (0, 1)]
    for e in entries:
        b.register_rank(srv.address, e)
    assert _call(srv.port, "GET") == (200, {"ranks": {"0": entries[0], "1": entries[1]}})
    got = b.fetch_ranks(srv.address, SECRET)
    assert got == {0: entries[0], 1: entries[1]}
    newer = b.entry_for(SECRET, _lay(1), "tcp://127.0.0.1:8001", "p", issued=entries[1]["issued"] + 1)
    b.register_rank(srv.address, newer)
    assert b.fetch_ranks(srv.address, SECRET)[1]["desk"] == "tcp://127.0.0.1:8001"
    assert srv.refused == 0


@pytest.mark.parametrize(
    "path, body, why",
    [
        ("/pdkv/other", b"{}", "PUT /pdkv/ranks with a body of 1-16384 bytes"),
        ("/pdkv/ranks", b"", "PUT /pdkv/ranks with a body of 1-16384 bytes"),
        ("/pdkv/ranks", b" " * (16 << 10) + b"{}", "PUT /pdkv/ranks with a body of 1-16384 bytes"),
        ("/pdkv/ranks", b"7", FIELDS),
        ("/pdkv/ranks", b"{not json", FIELDS),
        ("/pdkv/ranks", b"[1, 2]", FIELDS),
    ],
)
def test_a_bad_put_is_refused_by_name(srv, path, body, why):
    assert _call(srv.port, "PUT", path, body) == (400, {"error": why})
    assert _call(srv.port, "PUT", path, body) == (400, {"error": why})
    assert srv.refused == 2 and _call(srv.port, "GET")[1] == {"ranks": {}}


def test_a_body_of_the_largest_size_is_read(srv):
    e = json.dumps(b.entry_for(SECRET, _lay(0), DESK, "p")).encode()
    assert _call(srv.port, "PUT", body=e + b" " * (b.MAX_BODY - len(e)))[0] == 200


def test_the_server_refuses_what_does_not_verify_is_stale_or_is_not_newer(srv):
    now = b._now_ms()
    cases = [
        (b.entry_for(b"x" * 32, _lay(0), DESK, "p"), BAD_MAC),
        (b.entry_for(SECRET, _lay(0), DESK, "p", issued=now - 61_000), "not issued within 60 s"),
        (b.entry_for(SECRET, _lay(0), DESK, "p", issued=now + 61_000), "not issued within 60 s"),
    ]
    for e, why in cases:
        code, body = _call(srv.port, "PUT", body=json.dumps(e).encode())
        assert code == 400 and why in body["error"], body
    assert srv.refused == 3
    # within the skew, in both directions
    first = b.entry_for(SECRET, _lay(0), DESK, "p", issued=now - 55_000)
    assert _call(srv.port, "PUT", body=json.dumps(first).encode())[0] == 200
    later = b.entry_for(SECRET, _lay(0), "tcp://127.0.0.1:9", "p", issued=now + 55_000)
    assert _call(srv.port, "PUT", body=json.dumps(later).encode())[0] == 200
    same = b.entry_for(SECRET, _lay(0), DESK, "p", issued=now + 55_000)  # as new: refused
    code, body = _call(srv.port, "PUT", body=json.dumps(same).encode())
    assert (code, body) == (400, {"error": "the rank's stored entry is as new or newer (replayed?)"})
    assert _call(srv.port, "GET")[1]["ranks"]["0"] == later and srv.refused == 4


def test_the_table_holds_at_most_max_ranks(srv, monkeypatch):
    monkeypatch.setattr(b, "MAX_RANKS", 2)
    for r in (0, 1):
        b.register_rank(srv.address, b.entry_for(SECRET, _lay(r, 4), DESK, "p"))
    with pytest.raises(PdkvError, match="registering rank 2 failed"):
        b.register_rank(srv.address, b.entry_for(SECRET, _lay(2, 4), DESK, "p"))
    code, body = _call(srv.port, "PUT", body=json.dumps(b.entry_for(SECRET, _lay(2, 4), DESK, "p")).encode())
    assert code == 400 and body["error"] == "more than 2 ranks"
    b.register_rank(srv.address, b.entry_for(SECRET, _lay(1, 4), DESK, "p"))  # a stored rank renews
    assert sorted(_call(srv.port, "GET")[1]["ranks"]) == ["0", "1"]


def test_other_paths_are_not_found(srv):
    assert _call(srv.port, "GET", "/") == (404, {"error": "GET /pdkv/ranks"})


def test_the_server_is_bounded():
    assert (b.MAX_BODY, b.MAX_RANKS, b.MAX_CONNS, b.MAX_CONNS_PER_SOURCE) == (16 << 10, 1024, 64, 16)
    assert (b.DEADLINE_S, b.MAX_SKEW_S, b.REREGISTER_S, b.STALE_S) == (5.0, 60.0, 10.0, 90.0)
    s = b.BootstrapServer("127.0.0.1", 0, SECRET)
    try:
        h = s._httpd
        assert (h.max_conns, h.max_per_source, h.deadline_s) == (64, 16, 5.0)
        assert h.RequestHandlerClass.timeout == 5.0
        assert s._thread.daemon and s._thread.name == "pdkv-sglang-bootstrap"
    finally:
        s.close()
    assert not s._thread.is_alive()


# ---------------------------------------------------------------------- the clients


def test_the_clients_name_an_address_nothing_answers():
    srv = b.BootstrapServer("127.0.0.1", 0, SECRET)
    addr = srv.address
    srv.close()
    with pytest.raises(PdkvError, match=f"pdkv bootstrap at {addr}: registering rank 0 failed"):
        b.register_rank(addr, b.entry_for(SECRET, _lay(0), DESK, "p"), timeout_s=2)
    with pytest.raises(PdkvError, match=f"pdkv bootstrap at {addr}: "):
        b.fetch_ranks(addr, SECRET, timeout_s=2)


class _Other(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


@pytest.mark.parametrize("body", [b"<html>", b"{}", b'{"ranks": 5}', b"[]", b'{"ranks": []}'])
def test_fetch_names_a_server_that_is_not_a_bootstrap(body):
    handler = type("H", (_Other,), {"body": body})
    httpd = http.server.HTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        with pytest.raises(PdkvError, match="not a pdkv bootstrap server|prefill ranks"):
            b.fetch_ranks(f"127.0.0.1:{httpd.server_address[1]}", SECRET)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_fetch_uses_only_entries_that_verify_are_fresh_and_complete(srv):
    now = b._now_ms()
    good = {r: b.entry_for(SECRET, _lay(r), f"tcp://127.0.0.1:{7000 + r}", "p") for r in (0, 1)}
    srv._ranks.update(good)
    assert b.fetch_ranks(srv.address, SECRET) == good
    with pytest.raises(PdkvError, match=r"prefill ranks \[\] registered"):
        b.fetch_ranks(srv.address, b"x" * 32)  # decode holds another secret: nothing verifies
    srv._ranks[1] = {**good[1], "desk": "tcp://10.0.0.1:1"}  # replaced by a peer without it
    with pytest.raises(PdkvError, match=r"prefill ranks \[0\] registered, verified and fresh \(TP sizes \[2\]\)"):
        b.fetch_ranks(srv.address, SECRET)
    # fresh means issued within STALE_S of decode's clock, either way
    for issued, ok in ((now - 89_000, True), (now - 91_000, False), (now + 89_000, True), (now + 91_000, False)):
        srv._ranks[1] = b.entry_for(SECRET, _lay(1), DESK, "p", issued=issued)
        if ok:
            assert b.fetch_ranks(srv.address, SECRET)[1]["issued"] == issued
        else:
            with pytest.raises(PdkvError, match=r"prefill ranks \[0\]"):
                b.fetch_ranks(srv.address, SECRET)
    # one TP size, every rank of it
    srv._ranks[1] = b.entry_for(SECRET, _lay(1, 4), DESK, "p")
    with pytest.raises(PdkvError, match=r"TP sizes \[2, 4\]"):
        b.fetch_ranks(srv.address, SECRET)
    srv._ranks.clear()
    srv._ranks[1] = good[1]
    with pytest.raises(PdkvError, match=r"prefill ranks \[1\] registered.*all ranks of one TP size are needed"):
        b.fetch_ranks(srv.address, SECRET)


def test_a_registration_renews_its_entry_and_survives_a_failure(srv, caplog):
    made = []

    def make():
        made.append(b.entry_for(SECRET, _lay(0, 1), DESK, "p", issued=b._now_ms() + len(made)))
        return made[-1]

    reg = b.Registration(srv.address, make, every_s=0.05)
    try:
        assert reg.registered == 1 and reg.address == srv.address
        wait_until(lambda: reg.registered >= 3, 5, "registered again")
    finally:
        reg.close()
    assert reg.registered == len(made)  # each one made, registered once
    assert b.fetch_ranks(srv.address, SECRET)[0] == made[-1]
    assert not reg._thread.is_alive() and reg._thread.name == "pdkv-sglang-register" and reg._thread.daemon
    reg = b.Registration(srv.address, make, every_s=0.05)
    try:
        srv._httpd.shutdown()
        srv._httpd.server_close()
        wait_until(lambda: [r for r in caplog.records if r.msg == "%s (retried in %g s)"], 5, "a failure logged")
        rec = next(r for r in caplog.records if r.msg == "%s (retried in %g s)")
        assert isinstance(rec.args[0], PdkvError) and rec.args[1] == 0.05 and rec.levelname == "WARNING"
        assert "registering rank 0 failed" in rec.getMessage() and rec.getMessage().endswith("(retried in 0.05 s)")
        assert reg._thread.is_alive()
    finally:
        reg.close()


def test_a_registration_renews_every_reregister_s_by_default(srv):
    reg = b.Registration(srv.address, lambda: b.entry_for(SECRET, _lay(0, 1), DESK, "p"))
    try:
        assert reg.every_s == b.REREGISTER_S and reg.registered == 1
    finally:
        reg.close()


def test_a_registration_that_fails_at_once_raises():
    s = b.BootstrapServer("127.0.0.1", 0, SECRET)
    addr = s.address
    s.close()
    with pytest.raises(PdkvError, match="registering rank 0 failed"):
        b.Registration(addr, lambda: b.entry_for(SECRET, _lay(0, 1), DESK, "p"))


# ---------------------------------------------------------------------- what the clients ask


class _Answer:
    """What ``urllib.request.urlopen`` gives the clients, recording what they read."""

    def __init__(self, body: bytes) -> None:
        self.body, self.reads = body, []

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def read(self, n=-1):
        self.reads.append(n)
        return self.body


def test_the_clients_bound_their_wait_and_what_they_read(monkeypatch):
    calls = []
    table = {"ranks": {"0": b.entry_for(SECRET, _lay(0, 1), DESK, "p")}}

    def urlopen(req, timeout=-1):
        calls.append((req, timeout))
        calls.append(_Answer(json.dumps(table).encode()))
        return calls[-1]

    monkeypatch.setattr(b.urllib.request, "urlopen", urlopen)
    b.register_rank("h:1", table["ranks"]["0"])
    (req, timeout), answer = calls[:2]
    assert (req.full_url, req.get_method(), timeout) == ("http://h:1/pdkv/ranks", "PUT", 5.0)
    assert req.get_header("Content-type") == "application/json" and answer.reads == [b.MAX_BODY]
    assert json.loads(req.data) == table["ranks"]["0"]
    b.register_rank("h:1", table["ranks"]["0"], timeout_s=0.5)
    assert calls[2][1] == 0.5
    calls.clear()
    assert b.fetch_ranks("h:1", SECRET) == {0: table["ranks"]["0"]}
    (url, timeout), answer = calls
    assert (url, timeout, answer.reads) == ("http://h:1/pdkv/ranks", 5.0, [b.MAX_BODY * 64 + 1])
    b.fetch_ranks("h:1", SECRET, timeout_s=0.5)
    assert calls[2][1] == 0.5


def test_the_edges_of_fresh_are_the_servers_and_decodes(srv):
    """Just past the skew (60 s) the server refuses; just past STALE_S (90 s) decode does."""
    e = b.entry_for(SECRET, _lay(0, 1), DESK, "p", issued=b._now_ms() - 60_030)
    code, body = _call(srv.port, "PUT", body=json.dumps(e).encode())
    assert code == 400 and "not issued within 60 s" in body["error"]
    srv._ranks[0] = b.entry_for(SECRET, _lay(0, 1), DESK, "p", issued=b._now_ms() - 90_030)
    with pytest.raises(PdkvError, match=r"prefill ranks \[\] registered"):
        b.fetch_ranks(srv.address, SECRET)


def test_the_servers_answers_are_json_with_their_length(srv, caplog):
    caplog.set_level("DEBUG", logger="pdkv.integrations.sglang.bootstrap")
    e = json.dumps(b.entry_for(SECRET, _lay(0, 1), DESK, "p")).encode()
    for method, body, code, want in (("PUT", e, 200, {"ok": True}), ("GET", None, 200, None), ("PUT", None, 400, None)):
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        c.request(method, "/pdkv/ranks", body)  # the bodiless PUT has no Content-Length
        r = c.getresponse()
        raw = r.read()
        assert r.status == code and r.getheader("Content-Type") == "application/json"
        assert int(r.getheader("Content-Length")) == len(raw) and (want is None or json.loads(raw) == want)
        c.close()
    assert json.loads(raw) == {"error": "PUT /pdkv/ranks with a body of 1-16384 bytes"}
    msgs = [r.getMessage() for r in caplog.records if r.name == "pdkv.integrations.sglang.bootstrap"]
    assert any(m.startswith("pdkv bootstrap: ") and '"GET /pdkv/ranks HTTP/1.1" 200' in m for m in msgs), msgs


def test_a_put_without_a_length_is_refused_at_once(srv):
    """No Content-Length: refused without waiting for a body."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=2) as c:
        c.sendall(b"PUT /pdkv/ranks HTTP/1.1\r\nHost: x\r\n\r\n")
        assert c.recv(64).startswith(b"HTTP/1.0 400")


def test_fresh_includes_its_edges(srv, monkeypatch):
    """With the clocks held: an entry exactly MAX_SKEW_S off the server's clock is stored,
    and one exactly STALE_S old is used by decode."""
    now = 1_800_000_000_000
    monkeypatch.setattr(b, "_now_ms", lambda: now)
    e = b.entry_for(SECRET, _lay(0, 1), DESK, "p", issued=now - 60_000)
    assert _call(srv.port, "PUT", body=json.dumps(e).encode())[0] == 200
    srv._ranks[0] = b.entry_for(SECRET, _lay(0, 1), DESK, "p", issued=now - 90_000)
    assert b.fetch_ranks(srv.address, SECRET)[0]["issued"] == now - 90_000
