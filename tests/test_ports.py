"""Every small port pdkv listens on besides decode's control port (prefill's pull endpoint,
an SGLang decode's aux endpoint, SGLang's bootstrap table), tried as an attacker without the
secret would, against the bounds docs/SECURITY.md states: connections held open, floods of
messages that do not verify, replayed messages, and tables that must forget.

The ports run in a process of their own (``tests/peers.py ports``) so that their
descriptors and memory are measured alone; what the pull endpoint and the prefill rank do
with a message is also driven in-process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import msgspec
import pytest
import zmq
from test_hostile import _rss_mib
from test_transfer import HERE, reap, wait_until

sys.path.insert(0, os.path.join(HERE, "..", "tools"))
from flood_ports import SECRET, fds, hold, legit  # noqa: E402  the tool measures what these tests check

from pdkv.integrations.core import pull as pullmod
from pdkv.integrations.core.endpoint import Limits
from pdkv.integrations.core.pull import PullClient, PullReq, PullServer

FD_SLACK = 24  # descriptors a port's process opens besides the connections (zmq's, the monitor's)


@pytest.fixture
def ports():
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "peers.py"), "ports", "--secret", SECRET.hex()],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    info = json.loads(p.stdout.readline())
    lines: list[dict] = []

    def read():
        for line in p.stdout:
            lines.append(json.loads(line))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    info["pid"], info["lines"] = p.pid, lines
    time.sleep(0.3)
    info["base_fds"], info["base_rss"] = fds(p.pid), _rss_mib(p.pid)
    try:
        yield info
    finally:
        p.terminate()
        try:
            p.wait(10)
        finally:
            reap(p)
        t.join(5)
        p.stdout.close()


def _port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _legit(info: dict, which: str) -> float:
    """A request of a peer with the secret to ``which``; seconds until it was served."""
    return legit(which, info, info["lines"])


@pytest.mark.multiproc
@pytest.mark.parametrize("which", ["pull", "aux", "boot"])
def test_idle_connections_to_a_port_hold_bounded_descriptors_and_a_peer_is_served(ports, which):
    """600 connections opened and left idle: the port's process holds at most its caps'
    worth of them (32 pending for the zmq endpoints, 64 for the bootstrap server), and a
    peer with the secret is served at once meanwhile."""
    port = ports["boot"] if which == "boot" else _port_of(ports[which])
    held = hold(port, 600)
    try:
        assert len(held) == 600
        time.sleep(0.5)
        cap = 64 if which == "boot" else Limits().max_pending
        grew = fds(ports["pid"]) - ports["base_fds"]
        assert grew <= cap + FD_SLACK, f"{which}: {grew} descriptors more with 600 idle connections"
        assert _legit(ports, which) < 2.0
    finally:
        for s in held:
            s.close()


@pytest.mark.multiproc
def test_pending_connections_end_at_the_authentication_deadline(ports):
    """A few connections that never send: closed ``auth_timeout_s`` after they connected
    (5 s), whatever the caps."""
    held = hold(_port_of(ports["pull"]), 3)
    try:
        time.sleep(Limits().auth_timeout_s + 1.0)
        for s in held:
            s.settimeout(2)
            try:
                while s.recv(4096):  # zmq's greeting, then the end: the port closed it
                    pass
            except ConnectionResetError:
                pass
    finally:
        for s in held:
            s.close()


@pytest.mark.multiproc
def test_a_flood_of_messages_that_do_not_verify_keeps_the_aux_endpoint_small(ports):
    """Four connections send messages of just under 8 MiB (what the endpoint once took) with
    a wrong MAC as fast as they can, and four more messages of the slot's size: the aux
    endpoint's process grows by at most 64 MiB (a message over the slot's size ends its
    connection unread, one that does not verify ends it at once), and a message of the
    secret's is written meanwhile."""
    from pdkv.integrations.sglang.aux import AuxMsg

    stop = threading.Event()
    ctx = zmq.Context(io_threads=2)
    peak = [ports["base_rss"]]
    big = zmq.Frame(msgspec.msgpack.encode(AuxMsg(pid="x", blobs=[os.urandom((8 << 20) - 4096), b"z"], mac=b"0" * 32)))
    small = zmq.Frame(msgspec.msgpack.encode(AuxMsg(pid="x", blobs=[os.urandom(64), b"z" * 16], mac=b"0" * 32)))

    def flood(frame):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 16)
        s.connect(ports["aux"])
        while not stop.is_set():
            try:
                s.send(frame, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                time.sleep(0.0005)
        s.close(0)

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_mib(ports["pid"]))
            time.sleep(0.05)

    threads = [threading.Thread(target=flood, args=(big if i < 4 else small,), daemon=True) for i in range(8)]
    threads.append(threading.Thread(target=sample, daemon=True))
    try:
        for t in threads:
            t.start()
        time.sleep(3.0)
        assert _legit(ports, "aux") < 2.0
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        ctx.destroy(linger=0)
    grew = peak[0] - ports["base_rss"]
    assert grew < 64, f"the aux endpoint grew by {grew:.0f} MiB under the flood"


# ---------------------------------------------------------------------- freshness: pulls


def _signed(pid: str, issued_ms: int, nonce: bytes | None = None) -> bytes:
    r = PullReq(pid=pid, binding=b"b" * 32, decode="tcp://127.0.0.1:1", nonce=nonce or os.urandom(16), issued=issued_ms)
    r = msgspec.structs.replace(r, mac=pullmod._req_mac(SECRET, r))
    return msgspec.msgpack.encode(r)


def _ask(sock, body: bytes) -> str:
    sock.send(body)
    assert sock.poll(5000), "no answer"
    return msgspec.msgpack.decode(sock.recv(), type=pullmod.PullAnswer).error


def test_a_recorded_pull_replayed_changes_nothing():
    """A pull captured off the wire and sent again (at once, or later) is refused: prefill
    sends a request once per pull a decode made. A pull issued outside the freshness window
    (a replay kept for later, or a clock far off) is refused too."""
    served = []
    srv = PullServer("tcp://127.0.0.1:0", lambda r: served.append(r.pid) or "", secret=SECRET)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(srv.address)
    try:
        now = int(time.time() * 1000)
        body = _signed("p1", now)
        assert _ask(s, body) == ""
        assert _ask(s, body) == "this pull was served already (replayed)"
        late = _ask(s, _signed("p2", now - int(pullmod.FRESH_S * 1000) - 5000))
        assert "not issued within 30 s of prefill's clock" in late
        ahead = _ask(s, _signed("p3", now + int(pullmod.FRESH_S * 1000) + 5000))
        assert "not issued within" in ahead
        assert served == ["p1"]
    finally:
        s.close(0)
        ctx.term()
        srv.close()


def test_the_nonces_a_pull_endpoint_remembers_are_bounded(monkeypatch):
    """Past MAX_NONCES pulls in the window, the newest is refused with why; once the window
    passes the endpoint serves again (its memory of nonces expires)."""
    monkeypatch.setattr(pullmod, "MAX_NONCES", 3)
    t = [1000.0]
    srv = PullServer("tcp://127.0.0.1:0", lambda r: "", secret=SECRET, clock=lambda: t[0])
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(srv.address)
    try:
        for i in range(3):
            assert _ask(s, _signed(f"p{i}", int(t[0] * 1000))) == ""
        assert "more than 3 pulls within 30 s" in _ask(s, _signed("p3", int(t[0] * 1000)))
        t[0] += 2 * pullmod.FRESH_S + 1
        assert _ask(s, _signed("p4", int(t[0] * 1000))) == ""
    finally:
        s.close(0)
        ctx.term()
        srv.close()


def test_a_message_that_does_not_verify_ends_its_connection_and_a_good_one_keeps_it():
    """A connection whose message verifies is kept (a decode's pulls go on one connection);
    one whose message does not is closed at once."""
    srv = PullServer("tcp://127.0.0.1:0", lambda r: "", secret=SECRET)
    try:
        port = _port_of(srv.address)
        good = PullClient((srv.address,), secret=SECRET, timeout_s=5)
        res = good.pull(srv.address, "ok", b"b" * 32, "tcp://127.0.0.1:1")
        wait_until(lambda: res.done, 5, "answered")
        bad = socket.create_connection(("127.0.0.1", port), timeout=5)
        bad.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x7f\x03")  # ZMTP greeting
        bad.recv(64)
        time.sleep(0.5)
        wait_until(lambda: srv.connections >= 2, 5, "both connections seen")
        assert srv.pending >= 1
        res2 = good.pull(srv.address, "ok2", b"b" * 32, "tcp://127.0.0.1:1")
        wait_until(lambda: res2.done and res2.error == "", 5, "the good connection still served")
        good.close()
        bad.close()
    finally:
        srv.close()


# ---------------------------------------------------------------------- freshness: bootstrap


def _put(port: int, entry: dict) -> tuple[int, str]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/pdkv/ranks", json.dumps(entry).encode(), {"Content-Type": "application/json"},
        method="PUT",
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _table(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/pdkv/ranks", timeout=5) as r:
        return json.loads(r.read())["ranks"]


def test_a_replayed_bootstrap_registration_changes_nothing():
    """A prefill rank's registration recorded and replayed after the rank registered again
    (or replayed once the process is dead, pointing decodes at its endpoint) is refused: the
    table keeps the newest entry. An entry issued outside the server's skew window is
    refused too, and one that goes stale is no longer used by decode."""
    from pdkv import KVLayout
    from pdkv.errors import PdkvError
    from pdkv.integrations.sglang import bootstrap as b

    lay = KVLayout(num_layers=2, kv_heads=2, head_dim=8, tokens_per_block=4, dtype="bf16", token_major=True)
    srv = b.BootstrapServer("127.0.0.1", 0, SECRET)
    try:
        now = int(time.time() * 1000)
        old = b.entry_for(SECRET, lay, "tcp://127.0.0.1:1111", "p", issued=now - 2000)
        new = b.entry_for(SECRET, lay, "tcp://127.0.0.1:2222", "p", issued=now - 1000)
        assert _put(srv.port, old)[0] == 200
        assert _put(srv.port, new)[0] == 200
        code, body = _put(srv.port, old)  # the recorded earlier registration, replayed
        assert code == 400 and "as new or newer (replayed?)" in body
        assert _put(srv.port, new)[0] == 400  # the latest, replayed as is
        assert _table(srv.port)["0"]["desk"] == "tcp://127.0.0.1:2222"
        far = b.entry_for(SECRET, lay, "tcp://127.0.0.1:3333", "p", issued=now - int(b.MAX_SKEW_S * 1000) - 5000)
        code, body = _put(srv.port, far)
        assert code == 400 and "not issued within 60 s" in body
        assert b.fetch_ranks(f"127.0.0.1:{srv.port}", SECRET)[0]["desk"] == "tcp://127.0.0.1:2222"
    finally:
        srv.close()
    # decode uses an entry only while it is fresh: a table whose rank stopped registering
    stale = b.BootstrapServer("127.0.0.1", 0, SECRET)
    try:
        stale._ranks[0] = b.entry_for(SECRET, lay, "tcp://127.0.0.1:1", "p", issued=now - int(b.STALE_S * 1000) - 1)
        with pytest.raises(PdkvError, match="registered, verified and fresh"):
            b.fetch_ranks(f"127.0.0.1:{stale.port}", SECRET)
    finally:
        stale.close()


def test_a_prefill_rank_registers_again_so_a_lost_table_heals():
    """The bootstrap server restarts empty (or holds a bad entry): the rank's next scheduled
    registration puts its entry back, without a restart of the rank."""
    from pdkv import KVLayout
    from pdkv.integrations.sglang import bootstrap as b

    lay = KVLayout(num_layers=2, kv_heads=2, head_dim=8, tokens_per_block=4, dtype="bf16", token_major=True)
    srv = b.BootstrapServer("127.0.0.1", 0, SECRET)
    port = srv.port
    reg = b.Registration(f"127.0.0.1:{port}", lambda: b.entry_for(SECRET, lay, "tcp://127.0.0.1:9", "p"), every_s=0.2)
    try:
        assert _table(port)["0"]["desk"] == "tcp://127.0.0.1:9"
        srv.close()
        srv = b.BootstrapServer("127.0.0.1", port, SECRET)  # restarted: empty
        # the table holds the entry once the PUT is served, a moment before the rank counts it
        wait_until(lambda: "0" in _table(port) and reg.registered >= 2, 5, "the rank registered again")
    finally:
        reg.close()
        srv.close()


# ---------------------------------------------------------------------- early pulls


def test_early_pulls_expire_and_a_full_table_recovers(monkeypatch):
    """Pulls for rooms SGLang never opens at this prefill (a request aborted before prefill
    saw it) are gone after their expiry (timeout + lease); a full table refuses the newest
    pull, naming why, and takes pulls again once entries expire."""
    np = pytest.importorskip("numpy")
    from pdkv.integrations.sglang import prefill_rank as pr
    from pdkv.integrations.sglang.bootstrap import BootstrapServer
    from pdkv.integrations.sglang.layouts import rank_pools
    from pdkv.integrations.sglang.sides import Settings, pid_of, room_binding

    monkeypatch.setattr(pr, "MAX_EARLY_PULLS", 3)
    bufs = [np.zeros((8, 4, 2, 16), np.uint8) for _ in range(4)]
    import types

    args = types.SimpleNamespace(
        engine_rank=0, kv_data_ptrs=[x.ctypes.data for x in bufs], kv_data_lens=[x.nbytes for x in bufs],
        kv_item_lens=[x[0].nbytes for x in bufs], kv_cache_dtype_str="bfloat16", page_size=4,
        total_kv_head_num=2, state_types=[],
    )  # fmt: skip
    pools = rank_pools(args, mla=False, tp_size=1)
    boot = BootstrapServer("127.0.0.1", 0, SECRET)
    rank = pr.PrefillRank(pools, Settings(secret=SECRET, timeout_s=0.3, lease_s=0.3), f"127.0.0.1:{boot.port}")
    try:

        def pull(room):
            return rank._on_pull(
                PullReq(
                    pid=pid_of(room, 0, 1), binding=room_binding(room), decode="tcp://a:1 tcp://b:2",
                    nonce=os.urandom(16), issued=int(time.time() * 1000),
                )
            )  # fmt: skip

        assert [pull(r) for r in (1, 2, 3)] == ["", "", ""]
        assert rank.early_pulls == 3
        assert "3 pulls wait for requests this prefill has not seen" in pull(4)
        time.sleep(0.7)  # past timeout + lease
        assert rank.early_pulls == 0
        assert pull(5) == ""  # room again
        out = rank.open(1)  # its early pull expired: the room opens with no decode known
        assert out.decodes == {}
    finally:
        rank.close()
        boot.close()
