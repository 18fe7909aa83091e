"""pdkv.integrations.sglang's two halves without SGLang: :class:`DecodeRank` (``sides``) and
:class:`PrefillRank` (``prefill_rank``) driven in plain ids in SGLang's order, as the backend's
classes in ``conn`` drive them, over loopback; and their rules, each refusal in its exact words,
with the clocks held where time decides. Seconds a run: the mutation tests of both modules.
(The same halves inside SGLang's own classes: test_sglang.py; real SGLang servers:
test_sglang_served.py.)"""

from __future__ import annotations

import hashlib
import os
import time
import types

import numpy as np
import pytest
from test_transfer import wait_until

from pdkv.errors import PdkvError, RequestError
from pdkv.integrations.core.pull import PullReq
from pdkv.integrations.sglang import prefill_rank, sides
from pdkv.integrations.sglang.bootstrap import BootstrapServer
from pdkv.integrations.sglang.layouts import rank_pools
from pdkv.integrations.sglang.prefill_rank import PrefillRank
from pdkv.integrations.sglang.sides import DecodeRank, Settings, aux_slots, pid_of, room_binding, sources_of

SECRET = bytes(range(32))
PAGE, LAYERS, HEADS, DIM = 4, 2, 4, 8
AUX = [16, 8]  # two metadata buffers: bytes per request slot
ENV = (
    "PDKV_SECRET",
    "PDKV_SECRET_FILE",
    "PDKV_SGLANG_INSTANCE_KEY",
    "PDKV_SGLANG_TRANSPORTS",
    "PDKV_SGLANG_TRANSPORT",
    "PDKV_SGLANG_HOST",
    "PDKV_SGLANG_TIMEOUT_S",
    "PDKV_SGLANG_LEASE_S",
    "PDKV_SGLANG_STAGING_MB",
)


def _settings(**kw) -> Settings:
    kw = {"secret": SECRET, "instance_key": b"k" * 32, "timeout_s": 5.0, "lease_s": 5.0, **kw}
    return Settings(**kw)


class Mem:
    """One rank's SGLang pools as numpy arrays (MHA: K of every layer, then V), its host
    pool and its aux buffers, and their ``KVArgs``."""

    def __init__(self, heads: int, pages: int = 32, host_pages: int = 0, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        shape = (pages, PAGE, heads, DIM * 2)  # bf16: two bytes an element
        self.kv = [rng.integers(0, 255, shape, dtype=np.uint8) for _ in range(2 * LAYERS)]
        self.host = [np.zeros((host_pages, *shape[1:]), np.uint8) for _ in range(2 * LAYERS)] if host_pages else []
        self.aux = [rng.integers(0, 255, (64, n), dtype=np.uint8) for n in AUX]

    def pools(self, rank: int, tp: int):
        a = types.SimpleNamespace(
            engine_rank=rank,
            kv_data_ptrs=[b.ctypes.data for b in self.kv],
            kv_data_lens=[b.nbytes for b in self.kv],
            kv_item_lens=[b[0].nbytes for b in self.kv],
            kv_cache_dtype_str="bfloat16",
            page_size=PAGE,
            total_kv_head_num=HEADS,
        )
        if self.host:
            a.host_kv_data_ptrs = [b.ctypes.data for b in self.host]
            a.host_kv_data_lens = [b.nbytes for b in self.host]
            a.host_kv_item_lens = [b[0].nbytes for b in self.host]
        return rank_pools(a, mla=False, tp_size=tp)

    def auxes(self) -> tuple[list[int], list[int]]:
        return [b.ctypes.data for b in self.aux], list(AUX)


class Pair:
    """A prefill instance of TP ``p`` (each rank a :class:`PrefillRank`), its bootstrap
    server, and a decode instance of TP ``d`` (each rank a :class:`DecodeRank`, with a
    host pool unless ``host_pool`` is false)."""

    def __init__(self, p: int = 1, d: int = 1, host_pool: bool = True, prefill=None, **decode) -> None:
        self.boot = BootstrapServer("127.0.0.1", 0, SECRET)
        self.addr = self.boot.address
        self.pmem = [Mem(HEADS // p, seed=10 + r) for r in range(p)]
        self.dmem = [Mem(HEADS // d, host_pages=32 if host_pool else 0, seed=20 + r) for r in range(d)]
        self.pre: list[PrefillRank] = []
        self.dec: list[DecodeRank] = []
        try:
            for r, m in enumerate(self.pmem):
                self.pre.append(PrefillRank(m.pools(r, p), _settings(**(prefill or {})), self.addr, aux=m.auxes()))
            for r, m in enumerate(self.dmem):
                self.dec.append(DecodeRank(m.pools(r, d), _settings(**decode), aux=m.auxes()))
        except BaseException:
            self.close()
            raise

    def start(self, room: int, dst: list[int], dest: str = "host", aux: int | None = 5, prefix: int = 0):
        """Decode's half of a request: ``KVReceiver.init`` and ``send_metadata``."""
        ins = [dr.start(room, self.addr) for dr in self.dec]
        for dr, r in zip(self.dec, ins):
            dr.publish(r, dst, aux, dest, prefix)
        return ins

    def send(self, room: int, src: list[int], aux: int | None = 3, opened=None):
        """Prefill's half: open (unless ``opened``), wait for every pull, then two chunks."""
        outs = opened or [pr.open(room) for pr in self.pre]
        for pr, o in zip(self.pre, outs):
            wait_until(lambda pr=pr, o=o: pr.status(o) == "waiting", 10, f"room {room} pulled")
            todo = src[pr.prefix(o) // PAGE :]
            pr.init(o, len(todo), aux)
            pr.send(o, todo[:2])
            pr.send(o, todo[2:])
        return outs

    def settle(self, ins, outs) -> None:
        for pr, o in zip(self.pre, outs):
            wait_until(lambda pr=pr, o=o: pr.status(o) in ("success", "failed"), 10, "prefill's outcome")
            assert o.state == "success", o.error
        for dr, r in zip(self.dec, ins):
            wait_until(lambda dr=dr, r=r: dr.status(r) in ("success", "failed"), 10, "decode's outcome")
            assert r.state == "success", r.error

    def close(self) -> None:
        for side in self.pre + self.dec:
            side.close()
        self.boot.close()


@pytest.fixture
def pair():
    made: list[Pair] = []

    def make(*a, **kw) -> Pair:
        made.append(Pair(*a, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _check(pair: Pair, src, dst, dest: str, aux_src: int | None = 3, aux_dst: int = 5, earlier=()) -> None:
    """Decode rank r's pages ``dst`` hold its heads of the prefill ranks' pages ``src``, its
    aux slot the aux source's, and every other page but ``earlier`` requests' is as it was (zero)."""
    d = len(pair.dmem)
    for r, dm in enumerate(pair.dmem):
        bufs = dm.host if dest == "host" else dm.kv
        for b, buf in enumerate(bufs):
            whole = [np.concatenate([pm.kv[b][s] for pm in pair.pmem], axis=1) for s in src]
            per = whole[0].shape[1] // d
            for w, t in zip(whole, dst):
                assert np.array_equal(buf[t], w[:, r * per : (r + 1) * per]), f"rank {r} buffer {b} page {t}"
            if dest == "host":
                rest = [p for p in range(len(buf)) if p not in dst and p not in earlier]
                assert not buf[rest].any(), f"rank {r} buffer {b}: a page outside the request was written"
        for i in range(len(AUX) if aux_src is not None else 0):
            assert np.array_equal(dm.aux[i][aux_dst], pair.pmem[0].aux[i][aux_src]), f"rank {r} aux {i}"


def _first_chunk_sent(pr: Pair, room: int, dst: list[int]):
    """A request of four pages whose first chunk of two reached decode: (decode's room,
    prefill's room); the second chunk is the caller's to send or not."""
    p = pr.pre[0]
    r = pr.start(room, dst)[0]
    out = p.open(room)
    wait_until(lambda: p.status(out) == "waiting", 10, "pulled")
    p.init(out, 4, None)
    p.send(out, [5, 6])
    wait_until(lambda: out.streams and next(iter(out.streams.values())).sent == 2, 10, "the first chunk")
    return r, out


class Clock:
    """A module's ``time`` with its monotonic clock held (from the real one's reading now,
    which records made with the real clock are compared to): ``now`` moves only when told."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


# ---------------------------------------------------------------------- settings and names


def _env(monkeypatch, **values) -> None:
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in values.items():
        monkeypatch.setenv(k, v)


def test_settings_read_every_variable(monkeypatch):
    _env(
        monkeypatch,
        PDKV_SECRET=SECRET.hex(),
        PDKV_SGLANG_INSTANCE_KEY="ab" * 16,
        PDKV_SGLANG_TRANSPORTS=" tcp, ,shm ,nixl",
        PDKV_SGLANG_TRANSPORT=" auto ",
        PDKV_SGLANG_HOST="10.1.2.3",
        PDKV_SGLANG_TIMEOUT_S="7.5",
        PDKV_SGLANG_LEASE_S="12",
        PDKV_SGLANG_STAGING_MB="64",
    )
    s = Settings.from_env()
    assert (s.secret, s.instance_key, s.host) == (SECRET, b"\xab" * 16, "10.1.2.3")
    assert (s.timeout_s, s.lease_s, s.staging_mb) == (7.5, 12.0, 64.0)
    assert (s.transports, s.transport, s.device_path) == (("tcp", "shm", "nixl"), "auto", "auto")


def test_settings_from_the_secret_alone_are_the_defaults(monkeypatch):
    _env(monkeypatch, PDKV_SECRET=SECRET.hex())
    s = Settings.from_env()
    assert s == Settings(secret=SECRET)
    assert (s.host, s.instance_key, s.timeout_s, s.lease_s) == ("127.0.0.1", None, 30.0, 30.0)
    assert (s.transports, s.transport, s.device_path, s.staging_mb) == (("tcp",), "tcp", "auto", 1024.0)
    assert SECRET.hex() not in repr(s)  # the secret and the instance key are not in its repr


def test_the_secret_file_wins_and_is_stripped(monkeypatch, tmp_path):
    f = tmp_path / "secret"
    f.write_text(f"  {'cd' * 20}\n")
    _env(monkeypatch, PDKV_SECRET=SECRET.hex(), PDKV_SECRET_FILE=str(f))
    assert Settings.from_env().secret == b"\xcd" * 20


@pytest.mark.parametrize(
    "raw", [None, "", "zz" * 16, "ab" * 15, "abc"], ids=["unset", "empty", "not-hex", "15-bytes", "odd"]
)
def test_a_secret_missing_short_or_not_hex_is_refused(monkeypatch, raw):
    _env(monkeypatch, **({"PDKV_SECRET": raw} if raw is not None else {}))
    with pytest.raises(PdkvError) as e:
        Settings.from_env()
    assert str(e.value) == (
        "pdkv's SGLang backend needs the pair's secret: PDKV_SECRET (or PDKV_SECRET_FILE), hex, >= 16 bytes"
    )


@pytest.mark.parametrize(
    "var, value, words",
    [
        ("PDKV_SGLANG_INSTANCE_KEY", "zz" * 16, "PDKV_SGLANG_INSTANCE_KEY must be hex, >= 16 bytes"),
        ("PDKV_SGLANG_INSTANCE_KEY", "ab" * 15, "PDKV_SGLANG_INSTANCE_KEY must be hex, >= 16 bytes"),
        ("PDKV_SGLANG_TIMEOUT_S", "30s", "PDKV_SGLANG_TIMEOUT_S='30s' is not a number"),
        ("PDKV_SGLANG_LEASE_S", "", "PDKV_SGLANG_LEASE_S='' is not a number"),
        ("PDKV_SGLANG_STAGING_MB", "1 GiB", "PDKV_SGLANG_STAGING_MB='1 GiB' is not a number"),
    ],
)
def test_a_setting_that_is_not_one_is_refused_by_name(monkeypatch, var, value, words):
    _env(monkeypatch, PDKV_SECRET=SECRET.hex(), **{var: value})
    with pytest.raises(PdkvError) as e:
        Settings.from_env()
    assert str(e.value) == words


def test_a_secret_of_16_bytes_is_enough(monkeypatch):
    _env(monkeypatch, PDKV_SECRET="ab" * 16)
    assert Settings.from_env().secret == b"\xab" * 16


@pytest.mark.parametrize(
    "kw, words",
    [
        (
            {"transports": ("tcp", "rdma")},
            "PDKV_SGLANG_TRANSPORTS='tcp,rdma': decode receives into SGLang's pages by tcp and nixl "
            "(at least one), and into its staging buffer by shm too",
        ),
        (
            {"transports": ("shm",)},
            "PDKV_SGLANG_TRANSPORTS='shm': decode receives into SGLang's pages by tcp and nixl "
            "(at least one), and into its staging buffer by shm too",
        ),
        (
            {"transports": ()},
            "PDKV_SGLANG_TRANSPORTS='': decode receives into SGLang's pages by tcp and nixl "
            "(at least one), and into its staging buffer by shm too",
        ),
        ({"device_path": "direct"}, "device_path='direct' must be 'auto' or 'staged'"),
        ({"staging_mb": 0}, "PDKV_SGLANG_STAGING_MB=0 must be a positive number of MiB"),
        ({"staging_mb": -1.0}, "PDKV_SGLANG_STAGING_MB=-1.0 must be a positive number of MiB"),
        ({"staging_mb": "64"}, "PDKV_SGLANG_STAGING_MB='64' must be a positive number of MiB"),
        ({"staging_mb": float("nan")}, "PDKV_SGLANG_STAGING_MB=nan must be a positive number of MiB"),
        ({"transport": "shm"}, "PDKV_SGLANG_TRANSPORT='shm': prefill sends by tcp, nixl or auto"),
    ],
    ids=["rdma", "shm-only", "none", "device-path", "mb-0", "mb-negative", "mb-string", "mb-nan", "transport"],
)
def test_settings_refuse_by_name(kw, words):
    with pytest.raises(PdkvError) as e:
        Settings(secret=SECRET, **kw)
    assert str(e.value) == words


@pytest.mark.parametrize(
    "kw",
    [
        {"transports": ("nixl",)},
        {"transports": ("shm", "tcp")},
        {"transport": "auto"},
        {"transport": "nixl"},
        {"device_path": "staged"},
        {"staging_mb": 0.5},
        {"staging_mb": 3},
    ],
)
def test_settings_take_what_pdkv_can_do(kw):
    s = Settings(secret=SECRET, **kw)
    assert all(getattr(s, k) == v for k, v in kw.items())


def test_names_a_request_carries():
    assert pid_of(7, 1, 2) == "sgl-7-d1of2"
    assert sides.PID_PATTERN.fullmatch(pid_of(2**64 - 1, 9999, 9999))
    assert room_binding(7) == hashlib.sha256(b"pdkv-sglang-room\x007").digest()
    assert room_binding(7) != room_binding(70)
    assert aux_slots([1000, 2000], [16, 8], 3) == [(1048, 16), (2024, 8)]
    assert aux_slots([1000], [16], 0) == [(1000, 16)]


def test_sources_are_the_prefill_ranks_holding_a_decode_ranks_heads():
    def lay(tp, rank):
        return Mem(HEADS // tp).pools(rank, tp).layout

    assert sources_of(lay(1, 0), lay(2, 1)) == [0]
    assert sources_of(lay(2, 0), lay(1, 0)) == [0, 1]
    assert sources_of(lay(4, 0), lay(2, 1)) == [2, 3]
    assert sources_of(lay(2, 1), lay(4, 1)) == [0]
    assert sources_of(lay(2, 1), lay(4, 3)) == [1]


def test_the_backend_never_swaps():
    with pytest.raises(PdkvError, match="^pdkv's SGLang backend does not swap: SGLang loads its own pages$"):
        sides._NoSwap().submit(1, x=2)


# ---------------------------------------------------------------------- whole requests


@pytest.mark.parametrize("dest", ["host", "device"])
@pytest.mark.parametrize("tp", [(1, 1), (1, 2), (2, 1)], ids=["tp1-1", "tp1-2", "tp2-1"])
def test_a_request_lands_byte_for_byte(pair, tp, dest):
    """Both destinations at TP 1-1, 1-2 and 2-1: every page and the aux slot arrive, no
    other page is touched, pdkv lets go of the pages, and the sender says what it sent."""
    pr = pair(*tp)
    src, dst = [7, 2, 9, 30, 5], [4, 11, 0, 31, 6]
    ins = pr.start(41, dst, dest)
    outs = pr.send(41, src)
    pr.settle(ins, outs)
    _check(pr, src, dst, dest)
    for p, o in zip(pr.pre, outs):
        assert o.bytes == len(src) * p.layout.block_bytes  # its heads, once over all decode ranks
        assert o.done == set(o.decodes) and len(o.decodes) == tp[1]
    for d, r in zip(pr.dec, ins):
        assert r.pid == pid_of(41, d.layout.tp_rank, tp[1])
        assert not d.pages[dest].holds(r.pid) and d.release_safe(r) and d.release_safe_room(41)
        assert all(p.done and not p.error for p in r.pulls)
        assert d.pages[dest].num_free == d.pages[dest].num_total


def test_prefill_may_open_the_room_before_or_after_decode_pulls(pair):
    """Pulls that come first wait as early pulls (counted) and are taken when SGLang opens
    the room; a room opened first takes its pulls as they come. The same session serves both."""
    pr = pair()
    p, d = pr.pre[0], pr.dec[0]
    ins = pr.start(1, [0, 1, 2, 3])
    wait_until(lambda: p.early_pulls == 1, 10, "an early pull")
    outs = pr.send(1, [4, 5, 6, 7])
    assert p.early_pulls == 0
    pr.settle(ins, outs)
    opened = [p.open(2)]
    assert p.status(opened[0]) == "bootstrapping" and p.prefix(opened[0]) == 0
    ins = pr.start(2, [8, 9, 10, 11])
    outs = pr.send(2, [12, 13, 14, 15], opened=opened)
    pr.settle(ins, outs)
    _check(pr, [12, 13, 14, 15], [8, 9, 10, 11], "host", earlier=[0, 1, 2, 3])
    assert len(p._senders) == 1 and d.status(ins[0]) == "success"


def test_a_prefix_decode_holds_is_not_sent(pair):
    """decode_prefix_len of two pages: prefill learns it from the pulls, sends only the
    pages past it, and they land page for page."""
    pr = pair()
    ins = pr.start(3, [20, 21, 22], prefix=2 * PAGE)
    out = pr.pre[0].open(3)
    assert pr.pre[0].prefix(out) == 0  # nothing known while bootstrapping
    outs = pr.send(3, [1, 2, 3, 4, 5], opened=[out])
    assert pr.pre[0].prefix(out) == 2 * PAGE
    pr.settle(ins, outs)
    assert out.pages == [3, 4, 5]
    _check(pr, [3, 4, 5], [20, 21, 22], "host")


def test_without_an_aux_slot_no_aux_is_sent_or_awaited(pair):
    pr = pair()
    ins = pr.start(4, [1, 2, 3], aux=None)
    assert ins[0].aux == [] and ins[0].aux_done
    outs = pr.send(4, [4, 5, 6], aux=None)
    pr.settle(ins, outs)
    _check(pr, [4, 5, 6], [1, 2, 3], "host", aux_src=None)
    assert not pr.pre[0]._aux._socks  # nothing was sent: no aux connection was opened


def test_a_staged_device_destination_is_copied_and_its_segment_removed_at_close(pair):
    """device_path=staged on a host pool: prefill writes pdkv's staging buffer, the swap
    engine copies it into SGLang's pages; the staging blocks go back, and the segment is
    gone once the rank closes."""
    pr = pair(host_pool=False, device_path="staged", staging_mb=1)
    d = pr.dec[0]
    assert d.staged and d.staging is not None and set(d.pages) == {"device"}
    ins = pr.start(5, [3, 1, 4], dest="device")
    outs = pr.send(5, [9, 2, 6])
    pr.settle(ins, outs)
    _check(pr, [9, 2, 6], [3, 1, 4], "device")
    wait_until(lambda: d.pages["device"].num_free == d.pages["device"].num_total, 10, "staging blocks back")
    assert ins[0].bound and d.release_safe(ins[0])
    name = d.staging.name
    assert os.path.exists(f"/dev/shm/{name.lstrip('/')}")
    d.close()
    assert not os.path.exists(f"/dev/shm/{name.lstrip('/')}")


def test_a_staging_buffer_that_holds_no_page_is_refused():
    m = Mem(HEADS)
    lay = m.pools(0, 1)
    with pytest.raises(PdkvError) as e:
        DecodeRank(lay, _settings(device_path="staged", staging_mb=0.0001), aux=m.auxes())
    per = lay.layout.block_bytes
    assert str(e.value) == f"PDKV_SGLANG_STAGING_MB=0.0001 holds no page of {per} bytes"


# ---------------------------------------------------------------------- decode's rules


def test_decode_refuses_metadata_it_cannot_serve(pair):
    pr = pair(host_pool=False)
    d = pr.dec[0]
    r = d.start(6, pr.addr)
    with pytest.raises(RequestError) as e:
        d.publish(r, [1], 0, "host")
    assert str(e.value) == "destination 'host' is not served by this decode rank (served: device)"
    for bad in (-PAGE, 3, PAGE + 1):
        with pytest.raises(RequestError) as e:
            d.publish(r, [1], 0, "device", bad)
        assert str(e.value) == f"decode_prefix_len={bad} is not a whole number of pages of {PAGE} tokens"
    assert r.state == "waiting" and d.pages["device"].designated(r.pid) is None
    d.publish(r, [1], None, "device", PAGE)
    with pytest.raises(RequestError) as e:
        d.publish(r, [2], None, "device")
    assert str(e.value) == "room 6: metadata sent twice"
    assert d.pages["device"].designated(r.pid) == (1,)


def test_a_room_in_flight_is_not_started_twice(pair):
    pr = pair()
    d = pr.dec[0]
    r = d.start(8, pr.addr)
    with pytest.raises(RequestError) as e:
        d.start(8, pr.addr)
    assert str(e.value) == "room 8 is already in flight at this decode rank"
    d.abort(r)
    assert r.state == "failed" and r.error == "aborted by SGLang"
    again = d.start(8, pr.addr)  # an ended room may come again
    assert again is not r and d.release_safe_room(8) is False
    d.forget(again)
    assert d.release_safe_room(8) and again.error == "cleared by SGLang"
    d.start(8, pr.addr)


def test_decode_without_a_prefill_instance_says_so(pair):
    pr = pair()
    pr.boot.close()
    with pytest.raises(PdkvError, match=r"^pdkv bootstrap at 127\.0\.0\.1:\d+: "):
        pr.dec[0].start(9, pr.addr)


def test_the_prefill_table_is_read_once_a_minute(pair, monkeypatch):
    pr = pair()
    d = pr.dec[0]
    clock, calls = Clock(), []
    real = sides.fetch_ranks
    monkeypatch.setattr(sides, "time", clock)
    monkeypatch.setattr(sides, "fetch_ranks", lambda *a: calls.append(a) or real(*a))
    ranks = d.prefill_ranks(pr.addr)
    assert calls == [(pr.addr, SECRET, 5.0)]
    assert d.pull.allowed == {ranks[0]["desk"]}
    clock.now += 60
    assert d.prefill_ranks(pr.addr) is ranks and len(calls) == 1
    clock.now += 0.001
    d.prefill_ranks(pr.addr)
    assert len(calls) == 2


@pytest.mark.parametrize("timeout, waited", [(2.0, 2.0), (10.0, 5.0)])
def test_the_table_read_waits_at_most_the_timeout_or_5_s(pair, monkeypatch, timeout, waited):
    pr = pair(timeout_s=timeout)
    calls = []
    monkeypatch.setattr(sides, "fetch_ranks", lambda *a: calls.append(a[2]) or {})
    with pytest.raises((KeyError, IndexError)):
        pr.dec[0].start(1, pr.addr)
    assert calls == [waited]


def test_a_refused_pull_fails_the_request_and_the_table_is_read_again(pair, monkeypatch):
    pr = pair()
    d = pr.dec[0]
    monkeypatch.setattr(prefill_rank, "MAX_EARLY_PULLS", 0)  # prefill refuses a pull for a room it has not seen
    r = pr.start(10, [1, 2])[0]
    wait_until(lambda: d.status(r) == "failed", 10, "the refusal")
    assert r.error == (
        "prefill refused the pull: 0 pulls wait for requests this prefill has not seen; "
        "refused until some expire (10 s)"
    )
    assert pr.addr not in d._prefills
    assert d.pages["host"].designated(r.pid) is None and d.release_safe(r)


def test_decode_gives_up_on_kv_that_does_not_come(pair, monkeypatch):
    pr = pair(timeout_s=1.0, lease_s=2.0)
    d = pr.dec[0]
    clock = Clock()
    monkeypatch.setattr(sides, "time", clock)
    r = pr.start(11, [1, 2])[0]
    wait_until(lambda: all(p.done for p in r.pulls), 10, "the pull answered")
    clock.now += 3.0
    assert d.status(r) == "transferring"
    clock.now += 0.001
    assert d.status(r) == "failed" and r.error == "no KV within 3 s"
    assert d.pages["host"].designated(r.pid) is None and d.release_safe(r)


def test_aux_lands_only_in_an_open_slot_of_its_size(pair):
    pr = pair()
    d = pr.dec[0]
    r = pr.start(12, [1, 2], aux=7)[0]
    assert r.aux == aux_slots(*pr.dmem[0].auxes(), 7) and not r.aux_done
    before = [a[7].copy() for a in pr.dmem[0].aux]
    assert d._on_aux("sgl-99-d0of1", [b"x" * 16, b"y" * 8]) == "no aux slot open for 'sgl-99-d0of1'"
    assert d._on_aux(r.pid, [b"x" * 16]) == "'sgl-12-d0of1': aux of [16] bytes; the slot is [16, 8]"
    assert d._on_aux(r.pid, [b"x" * 16, b"y" * 9]) == "'sgl-12-d0of1': aux of [16, 9] bytes; the slot is [16, 8]"
    assert all(np.array_equal(a[7], b) for a, b in zip(pr.dmem[0].aux, before))  # refused: nothing written
    assert d._on_aux(r.pid, [b"x" * 16, b"y" * 8]) == ""
    assert pr.dmem[0].aux[0][7].tobytes() == b"x" * 16 and pr.dmem[0].aux[1][7].tobytes() == b"y" * 8
    assert r.aux_done
    assert d._on_aux(r.pid, [b"z" * 16, b"z" * 8]) == "no aux slot open for 'sgl-12-d0of1'"
    assert pr.dmem[0].aux[0][7].tobytes() == b"x" * 16


def test_an_aborted_request_takes_no_aux_and_lets_its_pages_go(pair):
    pr = pair()
    d = pr.dec[0]
    r = pr.start(13, [1, 2], aux=7)[0]
    before = pr.dmem[0].aux[0][7].copy()
    d.abort(r, "the client went away")
    assert (r.state, r.error, r.aux) == ("failed", "the client went away", [])
    assert d._on_aux(r.pid, [b"x" * 16, b"y" * 8]) == "no aux slot open for 'sgl-13-d0of1'"
    assert np.array_equal(pr.dmem[0].aux[0][7], before)
    assert d.pages["host"].designated(r.pid) is None
    d.abort(r, "again")
    assert r.error == "the client went away"  # the first reason stands
    assert d.status(r) == "failed"


def test_an_aborted_room_before_metadata_holds_nothing(pair):
    pr = pair()
    d = pr.dec[0]
    r = d.start(14, pr.addr)
    assert not d.release_safe(r)  # waiting: SGLang may still send metadata
    d.abort(r)
    assert d.release_safe(r) and r.dest == ""


# ---------------------------------------------------------------------- prefill's rules


def _pull(room: int, d: int = 0, dtp: int = 1, decode: str = "tcp://127.0.0.1:1 tcp://127.0.0.1:2", **kw) -> PullReq:
    kw.setdefault("binding", room_binding(room))
    return PullReq(pid=kw.pop("pid", pid_of(room, d, dtp)), decode=decode, nonce=b"n" * 16, **kw)


@pytest.fixture
def lone(pair, monkeypatch):
    """One prefill rank (timeout 4 s, lease 6 s) whose sends never start: its rules alone.
    ``kicks`` records the streams it would have started."""
    p = pair(prefill={"timeout_s": 4.0, "lease_s": 6.0}).pre[0]
    clock, kicks = Clock(), []
    monkeypatch.setattr(prefill_rank, "time", clock)

    def kick(out, st):
        assert out.streams[st.pid] is st, "a stream kicked with another request's room"
        kicks.append(st.pid)

    monkeypatch.setattr(p, "_kick", kick)
    return p, clock, kicks


@pytest.mark.parametrize(
    "req, why",
    [
        (_pull(1, pid="vllm-1"), "not an SGLang request id"),
        (_pull(1, pid="sgl-1-d0of1x"), "not an SGLang request id"),
        (_pull(1, d=1, dtp=1), "decode rank out of range"),
        (_pull(1, d=2, dtp=2), "decode rank out of range"),
        (_pull(1, binding=room_binding(2)), "the binding is not the room's"),
        (_pull(1, decode="tcp://127.0.0.1:1"), "decode must name its control and aux endpoints"),
        (_pull(1, decode="tcp://127.0.0.1:1 ipc:///x"), "decode must name its control and aux endpoints"),
        (_pull(1, decode="tcp://a:1 tcp://a:2 tcp://a:3"), "decode must name its control and aux endpoints"),
        (_pull(1, decode="tcp://a:1  tcp://a:2"), "decode must name its control and aux endpoints"),
        (_pull(1, decode="tcp://a:1\ttcp://a:2"), "decode must name its control and aux endpoints"),
    ],
    ids=[
        *("vllm", "suffix", "rank-1-of-1", "rank-2-of-2", "binding"),
        *("one-endpoint", "ipc", "three", "two-spaces", "tab"),
    ],
)
def test_a_pull_is_refused_by_name(lone, req, why):
    p, _, kicks = lone
    assert p._on_pull(req) == why
    assert p.early_pulls == 0 and kicks == []


def test_a_pull_from_a_layout_that_cannot_pair_is_refused(lone):
    p, _, _ = lone
    why = p._on_pull(_pull(1, d=0, dtp=3))
    assert why.startswith("this prefill's layout cannot write that decode's: ")
    with pytest.raises(PdkvError) as e:
        sources_of(p.layout, p._decode_layout(0, 3))
    assert why == f"this prefill's layout cannot write that decode's: {e.value}"


def test_a_prefill_of_tp_2_needs_the_instance_key():
    m = Mem(HEADS // 2)
    with pytest.raises(PdkvError) as e:
        PrefillRank(m.pools(0, 2), _settings(instance_key=None), "127.0.0.1:1")
    assert str(e.value) == (
        "a prefill of TP > 1 needs PDKV_SGLANG_INSTANCE_KEY (hex, >= 16 bytes, the same on every "
        "rank): it is what makes the ranks one instance at decode"
    )


def test_a_request_pulled_by_another_decode_rank_is_refused(lone):
    p, _, _ = lone
    assert p._on_pull(_pull(1)) == ""
    assert p._on_pull(_pull(1, decode="tcp://127.0.0.1:9 tcp://127.0.0.1:2")) == (
        "this request was pulled by another decode rank already"
    )
    assert p._on_pull(_pull(1, decode="tcp://127.0.0.1:1 tcp://127.0.0.1:7")) == ""  # the same rank again
    out = p.open(1)
    assert out.decodes == {pid_of(1, 0, 1): ("tcp://127.0.0.1:1", "tcp://127.0.0.1:7", 1, 0)}
    assert p._on_pull(_pull(1, decode="tcp://127.0.0.1:9 tcp://127.0.0.1:2")) == (
        "this request was pulled by another decode rank already"
    )


def test_early_pulls_expire_after_the_timeout_and_lease(lone):
    p, clock, _ = lone
    assert p._on_pull(_pull(1)) == ""
    clock.now += 5
    assert p._on_pull(_pull(2)) == ""
    assert p.early_pulls == 2
    clock.now += 5  # room 1's pull is 10 s old: timeout + lease
    assert p.early_pulls == 1
    out = p.open(1)
    assert out.decodes == {} and out.state == "bootstrapping"  # its pull expired
    clock.now += 4.999
    out = p.open(2)
    assert list(out.decodes) == [pid_of(2, 0, 1)] and out.state == "waiting"
    assert p.early_pulls == 0


def test_an_early_pull_past_its_expiry_is_not_taken_by_open(lone):
    p, clock, _ = lone
    p._on_pull(_pull(3))
    clock.now += 10
    assert p.open(3).decodes == {}


def test_a_full_table_of_early_pulls_refuses_new_rooms_until_some_expire(lone, monkeypatch):
    p, clock, _ = lone
    monkeypatch.setattr(prefill_rank, "MAX_EARLY_PULLS", 2)
    assert p._on_pull(_pull(1)) == ""
    clock.now += 1
    assert p._on_pull(_pull(2)) == ""
    full = "2 pulls wait for requests this prefill has not seen; refused until some expire (10 s)"
    assert p._on_pull(_pull(3)) == full
    assert p._on_pull(_pull(2, decode="tcp://127.0.0.1:1 tcp://127.0.0.1:5")) == ""  # a known room is no new entry
    assert p.open(3).decodes == {}
    clock.now += 9
    assert p._on_pull(_pull(4)) == ""  # room 1's expired
    assert p.early_pulls == 2


def test_the_request_waits_for_every_decode_rank_then_sends(lone):
    p, _, kicks = lone
    out = p.open(5)
    assert p._on_pull(_pull(5, 0, 2)) == ""
    assert out.state == "bootstrapping" and out.expected == 2 and p.prefix(out) == 0
    assert p._on_pull(_pull(5, 1, 2)) == ""
    assert out.state == "waiting" and kicks == []
    p.init(out, 3, 4)
    assert (out.num_pages, out.aux_index, out.state, kicks) == (3, 4, "waiting", [])
    p.send(out, [7])
    assert out.state == "waiting" and sorted(kicks) == [pid_of(5, 0, 2), pid_of(5, 1, 2)]
    p.send(out, [8, 9])
    assert out.state == "transferring" and out.pages == [7, 8, 9]
    out.done = set(out.decodes)
    p._advance(out)
    assert out.state == "success"


def test_a_request_of_no_pages_fails_by_name(pair):
    p = pair(prefill={"timeout_s": 4.0}).pre[0]
    out = p.open(6)
    p._on_pull(_pull(6))
    p.init(out, 0, None)
    wait_until(lambda: p.status(out) == "failed", 10, "the failure")
    assert out.error == "sending to tcp://127.0.0.1:1: no pages to send"


@pytest.mark.parametrize(
    "pulls, why",
    [
        ([_pull(7, 0, 1), _pull(7, 1, 2)], "decode ranks of different TP sizes pulled one request"),
        (
            [_pull(7, 0, 2), _pull(7, 1, 2, prefix=PAGE)],
            "decode ranks hold prefixes of different lengths (decode_prefix_len)",
        ),
        ([_pull(7, prefix=PAGE + 1)], f"decode_prefix_len={PAGE + 1} is not a whole number of pages"),
    ],
    ids=["tp-sizes", "prefixes", "part-page"],
)
def test_pulls_that_disagree_fail_the_request(lone, pulls, why):
    p, _, kicks = lone
    out = p.open(7)
    p.init(out, 1, None)
    for r in pulls:
        p._on_pull(r)
    assert (out.state, out.error, kicks) == ("failed", why, [])


def test_more_pages_than_init_said_fail_the_request_and_later_ones_are_ignored(lone):
    p, _, _ = lone
    out = p.open(8)
    p.init(out, 1, None)
    p.send(out, [1, 2])
    assert (out.state, out.error) == ("failed", "2 pages sent; init said 1")
    p.send(out, [3])
    assert out.pages == [1, 2]


@pytest.mark.parametrize("when", ["bootstrapping", "between chunks", "transferring"])
def test_prefill_gives_up_on_what_does_not_come(lone, when):
    """Bound: 10 s (timeout + lease) for every pull, 10 s between chunks once pages flow
    (waiting with none yet is SGLang's queue, unbounded here), 14 s for decode's outcome."""
    p, clock, _ = lone
    out = p.open(9)
    clock.now = out.created  # made on the real clock
    limit, state, why = 10.0, "bootstrapping", "not every decode rank pulled within 10 s"
    if when != "bootstrapping":
        p._on_pull(_pull(9))
        p.init(out, 2, None)
        clock.now += 100
        assert p.status(out) == "waiting"  # no page yet: SGLang's queue
        p.send(out, [1])
        state, why = "waiting", "SGLang handed over no further pages within 10 s"
    if when == "transferring":
        p.send(out, [2])
        limit, state, why = 14.0, "transferring", "no outcome from decode in time"
    clock.now += limit
    assert p.status(out) == state
    clock.now += 0.001
    assert p.status(out) == "failed" and out.error == why


def test_a_failure_ends_the_reserved_streams_at_decode(lone):
    p, _, kicks = lone
    out = p.open(10)
    p._on_pull(_pull(10, 0, 2))
    p._on_pull(_pull(10, 1, 2))
    p.init(out, 2, None)
    p.send(out, [1])
    kicks.clear()
    out.streams[pid_of(10, 0, 2)].tx = object()  # reserved at decode rank 0 only
    p.abort(out, "the client went away")
    assert (out.state, out.error, kicks) == ("failed", "the client went away", [pid_of(10, 0, 2)])
    p.abort(out, "again")
    assert out.error == "the client went away"


def test_a_forgotten_room_may_be_opened_again(lone):
    p, _, _ = lone
    out = p.open(11)
    with pytest.raises(RequestError) as e:
        p.open(11)
    assert str(e.value) == "room 11 is already in flight at this prefill rank"
    p.forget(out)
    assert (out.state, out.error) == ("failed", "cleared by SGLang")
    assert p.open(11) is not out
    p.abort(p._rooms[11])
    assert p._rooms[11].error == "aborted by SGLang"
    p.open(11)


def test_the_aux_comes_from_the_lowest_prefill_rank_that_writes_a_decode_rank(pair):
    pr = pair(2, 1)
    lo, hi = pr.pre
    assert lo._is_aux_source(pid_of(1, 0, 1)) and not hi._is_aux_source(pid_of(1, 0, 1))
    assert lo._is_aux_source(pid_of(1, 0, 2)) and not lo._is_aux_source(pid_of(1, 1, 2))
    assert hi._is_aux_source(pid_of(1, 1, 2)) and not hi._is_aux_source(pid_of(1, 0, 2))


def test_a_decode_that_fails_the_request_fails_it_at_prefill(pair):
    """decode ends its grant after the first chunk: prefill's next send learns it and the
    request fails there, naming decode's answer; the next request succeeds."""
    pr = pair()
    p, d = pr.pre[0], pr.dec[0]
    r, out = _first_chunk_sent(pr, 12, [1, 2, 3, 4])
    d.abort(r, "decode said no")
    p.send(out, [7, 8])
    wait_until(lambda: p.status(out) == "failed", 10, "prefill's failure")
    assert out.error.startswith(f"sending to {d.receivers['host'].control_address}: ")
    ins = pr.start(13, [9, 10, 11, 12])
    outs = pr.send(13, [13, 14, 15, 16])
    pr.settle(ins, outs)
    _check(pr, [13, 14, 15, 16], [9, 10, 11, 12], "host", earlier=[1, 2])


def test_a_room_that_ended_may_be_opened_again_and_takes_nothing_more(lone):
    p, _, kicks = lone
    out = p.open(12)
    p._on_pull(_pull(12))
    out.state = "success"
    p.send(out, [1])
    p.abort(out, "late")
    p.init(out, 1, None)
    assert (out.pages, out.state, out.error, kicks) == ([], "success", "", [])
    again = p.open(12)
    assert again is not out and p._rooms[12] is again


def test_forgetting_an_ended_room_keeps_the_room_opened_again(lone):
    p, _, _ = lone
    old = p.open(13)
    p.abort(old)
    new = p.open(13)
    p.forget(old)
    assert p._rooms[13] is new
    p.forget(new)
    assert 13 not in p._rooms


def test_a_request_of_no_pages_starts_sending_at_once(lone):
    """init(0) once every decode rank pulled: transferring, and its stream starts (which
    fails it by name: test_a_request_of_no_pages_fails_by_name)."""
    p, _, kicks = lone
    out = p.open(14)
    p._on_pull(_pull(14))
    p.init(out, 0, None)
    assert out.state == "transferring" and kicks == [pid_of(14, 0, 1)]
    p.send(out, [1])
    assert (out.state, out.error) == ("failed", "1 pages sent; init said 0")


def test_the_prefix_is_told_only_once_every_decode_rank_pulled(lone):
    p, _, _ = lone
    out = p.open(15)
    p._on_pull(_pull(15, 0, 2, prefix=2 * PAGE))
    assert out.prefix == 2 * PAGE and out.state == "bootstrapping" and p.prefix(out) == 0
    p._on_pull(_pull(15, 1, 2, prefix=2 * PAGE))
    assert p.prefix(out) == 2 * PAGE


def test_a_prefill_rank_of_tp_1_needs_no_instance_key_and_names_itself(pair):
    pr = pair(prefill={"instance_key": None})
    p = pr.pre[0]
    assert p.instance == f"sglang-prefill-{pr.addr}" and len(p._key) == 32 and p._key != pr.pre[0].settings.secret
    assert p._aux_ptrs == pr.pmem[0].auxes()[0] and p._aux_items == AUX
    assert p._pool._max_workers == 8
    from pdkv.integrations.sglang.bootstrap import fetch_ranks

    entry = fetch_ranks(pr.addr, SECRET)[0]
    assert (entry["instance"], entry["desk"]) == (p.instance, p.desk.address)
    named = PrefillRank(pr.pmem[0].pools(0, 1), _settings(), pr.addr, instance="mine", workers=3)
    try:
        assert named.instance == "mine" and named._key == b"k" * 32 and named._pool._max_workers == 3
        assert fetch_ranks(pr.addr, SECRET)[0]["instance"] == "mine"
    finally:
        named.close()


def test_a_prefill_whose_bootstrap_is_gone_fails_at_start_and_leaves_nothing_open(monkeypatch):
    made = []

    class Desk(prefill_rank.PullServer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(prefill_rank, "PullServer", Desk)
    m = Mem(HEADS)
    with pytest.raises(PdkvError, match=r"^pdkv bootstrap at 127\.0\.0\.1:1: registering rank 0 failed: "):
        PrefillRank(m.pools(0, 1), _settings(), "127.0.0.1:1", aux=m.auxes())
    assert len(made) == 1 and made[0]._sock.closed


def test_close_waits_for_a_running_send_and_drops_queued_ones(pair):
    import threading

    pr = pair()
    p = PrefillRank(pr.pmem[0].pools(0, 1), _settings(), pr.addr, workers=1)
    gate, ran = threading.Event(), []
    p._pool.submit(gate.wait, 10)
    p._pool.submit(ran.append, "queued")
    closer = threading.Thread(target=p.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive()  # the running send ends first
    gate.set()
    closer.join(10)
    assert not closer.is_alive() and ran == []
    assert not p.registration._thread.is_alive() and p.desk._sock.closed


# ---------------------------------------------------------------------- prefill's sends


class FakeTx:
    """A :class:`PrefillSender` stand-in recording what a stream asks of it. ``written``
    stays false once ``gather`` is set (a session still writing the earlier chunks)."""

    def __init__(self, layout, cache, control, **kw) -> None:
        self.args, self.kw = (layout, cache, control), kw
        self.broken = self.closed = self.gather = False
        self.handed_over = 0
        self.reserved, self.chunks, self.finished, self.waits, self.outcomes = [], [], [], [], []
        self.reserve_answer: object = None
        self.outcome = types.SimpleNamespace(state="received", reason="")
        self.finish_raises = False

    def reserve_many(self, items):
        self.reserved.append(items)
        return [self.reserve_answer]

    def send_chunk(self, layer, pid, pages, start):
        self.chunks.append((layer, pid, list(pages), start))
        self.handed_over += 1

    def written(self, mark):
        return not self.gather

    def wait_written(self, mark, timeout):
        self.waits.append((mark, timeout))

    def finish(self, pid, ok=True, error=""):
        self.finished.append((pid, ok, error))
        if self.finish_raises:
            raise PdkvError("the session is gone")

    def wait_outcome(self, pid, timeout):
        self.outcomes.append((pid, timeout))
        return self.outcome

    def close(self):
        self.closed = True


@pytest.fixture
def sends(pair, monkeypatch):
    """One prefill rank (timeout 4 s, lease 6 s) whose sessions are :class:`FakeTx`
    (``made``), and a way to hand it a request pulled by one decode rank."""
    made: list[FakeTx] = []
    prepared: dict = {}

    def tx(*a, **kw):
        t = FakeTx(*a, **kw)
        for k, v in prepared.items():
            setattr(t, k, v)
        made.append(t)
        return t

    monkeypatch.setattr(prefill_rank, "PrefillSender", tx)
    p = pair(prefill={"timeout_s": 4.0, "lease_s": 6.0}).pre[0]

    def start(room: int, n: int):
        out = p.open(room)
        assert p._on_pull(_pull(room)) == ""
        p.init(out, n, None)
        return out

    return p, made, start, prepared


CTL = "tcp://127.0.0.1:1"


def test_a_stream_reserves_sends_each_chunk_layer_by_layer_confirms_and_awaits(sends):
    p, made, start, _ = sends
    out = start(20, 3)
    pid = pid_of(20, 0, 1)
    p.send(out, [4, 5])
    wait_until(lambda: made and len(made[0].chunks) == p.layout.total_layers, 10, "the first chunk")
    p.send(out, [6])
    wait_until(lambda: p.status(out) == "success", 10, "the request sent")
    (tx,) = made
    assert tx.args == (p.layout, p.cache, CTL)
    assert tx.kw == {
        "instance": p.instance,
        "instance_key": b"k" * 32,
        "secret": SECRET,
        "transport": "tcp",
        "timeout_s": 4.0,
    }
    assert tx.reserved == [[(pid, 3 * PAGE, room_binding(20))]]
    layers = range(p.layout.total_layers)
    assert tx.chunks == [(lay, pid, [4, 5], 0) for lay in layers] + [(lay, pid, [6], 2) for lay in layers]
    assert tx.finished == [(pid, True, "")] and tx.outcomes == [(pid, 10.0)] and tx.waits == []
    st = out.streams[pid]
    assert (st.sent, st.ended, st.tx, out.done, out.bytes) == (3, True, tx, {pid}, 3 * p.layout.block_bytes)
    assert p._senders == {(CTL, 1): tx}


def test_chunks_that_come_while_earlier_ones_are_written_wait_once_then_go_as_one(sends):
    """While the session still writes the request's earlier chunks, the stream waits for
    them once, at most the timeout, then sends what came meanwhile as one write; each later
    chunk waits again."""
    p, made, start, _ = sends
    out = start(21, 4)
    pid = pid_of(21, 0, 1)
    p.send(out, [1])
    wait_until(lambda: made and len(made[0].chunks) == p.layout.total_layers, 10, "the first chunk")
    tx = made[0]
    tx.gather = True  # never written: each wait runs out
    p.send(out, [2])
    wait_until(lambda: len(tx.chunks) == 2 * p.layout.total_layers, 10, "the second chunk")
    mark = tx.handed_over
    p.send(out, [3, 4])
    wait_until(lambda: p.status(out) in ("success", "failed"), 10, "the request sent")
    assert out.state == "success", out.error
    n = p.layout.total_layers
    assert tx.waits == [(n, 4.0), (mark, 4.0)]
    assert [c[2:] for c in tx.chunks[::n]] == [([1], 0), ([2], 1), ([3, 4], 2)]
    assert out.streams[pid].ended


def test_decodes_answer_other_than_received_fails_the_request_by_name(sends):
    p, made, start, prepared = sends
    prepared["outcome"] = types.SimpleNamespace(state="aborted", reason="the grant ended")
    out = start(22, 1)
    pid = pid_of(22, 0, 1)
    p.send(out, [7])
    wait_until(lambda: p.status(out) == "failed", 10, "the failure")
    why = f"sending to {CTL}: decode answered aborted: the grant ended"
    assert out.error == why
    assert made[0].finished == [(pid, True, ""), (pid, False, why)] and out.streams[pid].ended
    assert out.done == set() and out.bytes == 0


def test_a_refused_reservation_fails_the_request_and_tells_decode_nothing(sends):
    p, made, start, prepared = sends
    prepared["reserve_answer"] = RequestError("no room for it")
    out = start(23, 1)
    p.send(out, [7])
    wait_until(lambda: p.status(out) == "failed", 10, "the failure")
    assert out.error == f"sending to {CTL}: no room for it"
    st = out.streams[pid_of(23, 0, 1)]
    assert made[0].finished == [] and st.tx is None and st.ended and made[0].chunks == []


def test_an_abort_after_the_reservation_ends_the_grant_at_decode(sends):
    p, made, start, _ = sends
    out = start(24, 3)
    pid = pid_of(24, 0, 1)
    p.send(out, [1])
    wait_until(lambda: made and len(made[0].chunks) == p.layout.total_layers, 10, "the first chunk")
    wait_until(lambda: not out.streams[pid].busy, 10, "the stream idle")
    p.abort(out, "the client went away")
    wait_until(lambda: out.streams[pid].ended, 10, "the stream ended")
    assert made[0].finished == [(pid, False, "the client went away")]
    p.send(out, [2, 3])
    time.sleep(0.1)
    assert len(made[0].chunks) == p.layout.total_layers  # nothing more is sent


def test_telling_decode_of_a_failure_is_bounded_in_words_and_never_raises():
    end = PrefillRank._end
    st = prefill_rank._Stream("sgl-1-d0of1", ("c", "a", 1, 0))
    end(st, "x")  # never reserved: nothing to tell
    st.tx = FakeTx(None, None, "c")
    end(st, "y" * 300)
    assert st.tx.finished == [("sgl-1-d0of1", False, "y" * 200)]
    st.tx.finish_raises = True
    end(st, "z")
    assert st.tx.finished[-1] == ("sgl-1-d0of1", False, "z")


def test_one_session_per_decode_rank_shared_and_replaced_when_broken(sends):
    import threading

    p, made, _, prepared = sends
    a = p._sender(CTL, 1)
    assert p._sender(CTL, 1) is a and p._sender(CTL, 2) is not a and len(made) == 2
    a.broken = True
    b = p._sender(CTL, 1)
    assert b is not a and a.closed and not b.closed and p._senders[(CTL, 1)] is b
    # two streams opening one session at once: one handshake, both get it
    slow = threading.Event()

    def opening(*args, **kw):
        slow.wait(0.2)
        t = FakeTx(*args, **kw)
        made.append(t)
        return t

    prefill_rank.PrefillSender = opening  # undone by the fixture's monkeypatch
    got: list = []
    ts = [threading.Thread(target=lambda: got.append(p._sender("tcp://127.0.0.1:9", 1))) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert len(got) == 2 and got[0] is got[1] and len(made) == 4


# ---------------------------------------------------------------------- decode's parts


def test_decodes_receivers_are_built_as_sglangs_pages_need(pair):
    """Each destination's receiver: SGLang's pool by its name, the settings' host for the
    control, data and aux endpoints, the lease, a full pool refusing at once, and no fence
    grace where tcp alone writes (it sees every write); nixl's one-sided writes keep it."""
    pr = pair(transports=("tcp",), timeout_s=7.0, lease_s=9.0, host="127.0.0.2")
    d = pr.dec[0]
    assert set(d.receivers) == {"device", "host"} and d.pull.timeout_s == 7.0
    from pdkv.integrations.sglang.aux import max_message

    assert d.aux_server.max_msg == max_message(AUX) and d.aux_server.address.startswith("tcp://127.0.0.2:")
    for dest, rx in d.receivers.items():
        assert rx.buffers[0].name == f"SGLang's {dest} KV pool"
        assert rx.control_address.startswith("tcp://127.0.0.2:") and rx.options.data_host == "127.0.0.2"
        o = rx.scheduler.options
        assert (o.bind, o.lease_s, o.on_full, o.fence_grace_s) == ("engine", 9.0, "reject", 0.0)
    default = sides.SchedulerOptions().fence_grace_s
    assert default > 0 and d._options(("tcp", "nixl"), on_full="reject").fence_grace_s == default


def test_a_staged_device_destination_beside_a_host_pool(pair):
    pr = pair(device_path="staged", staging_mb=1, transports=("tcp", "shm"))
    d = pr.dec[0]
    assert set(d.receivers) == {"device", "host"} and isinstance(d.pages["host"], sides.EnginePages)
    o = d.receivers["device"].scheduler.options
    assert (o.on_full, o.queue_timeout_s, o.direct_to_gpu, o.fence_grace_s) == (
        "queue",
        5.0,
        False,
        sides.SchedulerOptions().fence_grace_s,  # shm writes are one-sided
    )
    assert d._swap.priority == "decode" and d._watch is not None


@pytest.mark.parametrize("fits, want", [(1.0, 1), (5.5, 5), (1000.0, 32)], ids=["one-page", "five-pages", "all"])
def test_the_staging_buffer_holds_what_its_mib_hold_up_to_the_pool(fits, want):
    m = Mem(HEADS)
    lay = m.pools(0, 1)
    per = sides.CacheSpec.buffer_bytes(lay.layout, 1)
    d = DecodeRank(lay, _settings(device_path="staged", staging_mb=fits * per / 2**20), aux=m.auxes())
    try:
        assert d.pages["device"].num_total == want and d.staging.size >= sides.CacheSpec.buffer_bytes(lay.layout, want)
    finally:
        d.close()


def test_aux_refusals_name_at_most_80_characters_of_the_id_and_8_sizes(pair):
    pr = pair()
    d = pr.dec[0]
    r = pr.start(16, [1], aux=2)[0]
    long = "x" * 100
    assert d._on_aux(long, []) == f"no aux slot open for {'x' * 80!r}"
    r.pid = "y" * 100
    d._rooms[r.pid] = r
    got = d._on_aux(r.pid, [b"a"] * 9)
    assert got == f"{'y' * 80!r}: aux of {[1] * 8} bytes; the slot is [16, 8]"


def test_a_destination_not_served_names_those_that_are(pair):
    pr = pair()
    d = pr.dec[0]
    r = d.start(17, pr.addr)
    with pytest.raises(RequestError) as e:
        d.publish(r, [1], None, "disk")
    assert str(e.value) == "destination 'disk' is not served by this decode rank (served: device, host)"


def test_a_room_that_ended_may_start_again_and_forgetting_the_old_keeps_the_new(pair):
    pr = pair()
    d = pr.dec[0]
    old = d.start(18, pr.addr)
    old.state = "success"
    new = d.start(18, pr.addr)
    d.forget(old)
    assert d._rooms[new.pid] is new and d.release_safe_room(18) is False
    d.forget(new)
    assert new.pid not in d._rooms


def test_release_safety_asks_the_pages_for_this_request(pair, monkeypatch):
    pr = pair()
    d = pr.dec[0]
    r = pr.start(19, [1, 2])[0]
    d.abort(r)
    asked = []
    monkeypatch.setattr(d.pages["host"], "holds", lambda pid: asked.append(pid) or True)
    assert d.release_safe(r) is False and asked == [r.pid]


def test_one_refused_pull_of_several_fails_the_request(pair):
    from pdkv.integrations.core.pull import PullResult

    pr = pair()
    d = pr.dec[0]
    r = d.start(20, pr.addr)
    d.publish(r, [1], None, "host")
    r.pulls = [PullResult(done=True), PullResult(done=False, error="late"), PullResult(done=True, error="no")]
    d._prefills.pop(pr.addr)  # read already dropped: a second failure finds nothing to drop
    assert d.status(r) == "failed" and r.error == "prefill refused the pull: no"


def test_a_request_without_aux_succeeds_only_once_received(pair):
    pr = pair()
    d = pr.dec[0]
    r = pr.start(21, [1, 2], aux=None)[0]
    assert d.status(r) == "transferring"
    outs = pr.send(21, [3, 4], aux=None)
    pr.settle([r], outs)
    assert d.status(r) == "success"


def test_a_grant_prefill_ended_fails_decode_naming_why(pair):
    pr = pair()
    p, d = pr.pre[0], pr.dec[0]
    sched = d.receivers["host"].scheduler
    r, out = _first_chunk_sent(pr, 22, [1, 2, 3, 4])
    p.abort(out, "the client went away")
    wait_until(lambda: d.status(r) == "failed", 10, "decode's failure")
    info = sched.request(r.pid)
    assert r.error == f"the transfer {info.state.value}: {info.reason}" and "the client went away" in r.error


def test_decode_ends_a_grant_naming_why(pair):
    pr = pair()
    d = pr.dec[0]
    sched = d.receivers["host"].scheduler
    r, _ = _first_chunk_sent(pr, 23, [1, 2, 3, 4])
    d.abort(r, "decode said no")
    assert sched.request(r.pid).reason == "decode said no"


def test_a_staged_request_succeeds_once_its_copy_ended_and_leaves_no_record(pair, monkeypatch):
    import threading

    pr = pair(host_pool=False, device_path="staged", staging_mb=1)
    d = pr.dec[0]
    sched = d.receivers["device"].scheduler
    gate = threading.Event()
    real = d._swap.copy_plan

    def gated(*a, **kw):
        gate.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(d._swap, "copy_plan", gated)
    r = pr.start(24, [3, 1], dest="device")
    outs = pr.send(24, [9, 2])
    wait_until(lambda: outs[0].state == "success", 10, "prefill's outcome")
    threading.Timer(0.3, gate.set).start()
    wait_until(lambda: d.status(r[0]) != "transferring" or r[0].bound, 10, "the copy bound")
    assert d.status(r[0]) == "transferring"  # received, not yet copied
    wait_until(lambda: d.status(r[0]) == "success", 10, "the copy")
    _check(pr, [9, 2], [3, 1], "device")
    assert sched.request(r[0].pid).state is sides.State.FINISHED  # SGLang reads its pages: pdkv is done


def test_a_staged_copy_that_cannot_start_fails_the_request_by_name(pair, monkeypatch):
    pr = pair(host_pool=False, device_path="staged", staging_mb=1)
    d = pr.dec[0]
    sched = d.receivers["device"].scheduler

    def refuse(pid, pages):
        raise PdkvError("no device pages")

    monkeypatch.setattr(sched, "bind", refuse)
    r = pr.start(25, [3, 1], dest="device")[0]
    pr.send(25, [9, 2])
    wait_until(lambda: d.status(r) == "failed", 10, "the failure")
    assert r.error == "its copy into the device pages could not start: no device pages"


def test_close_ends_the_pull_client_the_aux_endpoint_and_the_receivers(pair):
    pr = pair()
    d = pr.dec[0]
    d.close()
    assert not d.pull._thread.is_alive() and d.aux_server._sock.closed


def test_a_staging_buffer_still_exported_at_close_is_named_and_unlinked(pair, monkeypatch, caplog):
    import logging

    pr = pair(host_pool=False, device_path="staged", staging_mb=1)
    d = pr.dec[0]
    name = d.staging.name

    def busy():
        raise PdkvError("a view is still exported")

    monkeypatch.setattr(d.staging, "close", busy)
    with caplog.at_level(logging.WARNING, logger="pdkv.integrations.sglang.sides"):
        d.close()
    assert caplog.messages == [f"pdkv decode: staging buffer {name}: a view is still exported"]
    assert not os.path.exists(f"/dev/shm/{name.lstrip('/')}")
