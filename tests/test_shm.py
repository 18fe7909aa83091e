from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import pickle
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv import BusyError, ClosedError, CudaUnavailableError, SharedBuffer, _ffi
from pdkv.buffer.shared import stripe_sizes
from pdkv.buffer.sweeper import clean_segments, scan_segments
from pdkv.cli.shm_tool import main as shm_main

TAG = os.environ["PDKV_SHM_TAG"]  # this run's segments (conftest.py): clean only those


def test_create_is_0600_populated_and_named(no_leaks):
    with SharedBuffer.create(1 << 20) as b:
        assert b.name.startswith(f"pdkv-{os.getpid()}-")
        st_ = os.stat(f"/dev/shm/{b.name}")
        assert stat.S_IMODE(st_.st_mode) == 0o600
        assert st_.st_size == 1 << 20
        assert b.owner and not b.closed
        from pdkv import _ffi

        assert b.pinned == (_ffi.cuda.device_count() > 0)  # pin="auto": pinned exactly where a GPU is
        b.buf[:4] = b"abcd"
        assert bytes(b.buf[:4]) == b"abcd"
    assert b.closed
    assert not os.path.exists(f"/dev/shm/{b.name}")


def test_names_are_unique_per_instance(no_leaks):
    with SharedBuffer.create(4096) as a, SharedBuffer.create(4096) as b:
        assert a.name != b.name


@pytest.mark.parametrize("bad", ["", "a/b", "/lead", "-x", "x" * 300, "sp ace", 5])
def test_bad_names_rejected(bad, no_leaks):
    with pytest.raises(ValueError, match="invalid"):
        SharedBuffer.create(4096, bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_sizes_rejected(bad, no_leaks):
    with pytest.raises(ValueError, match="size"):
        SharedBuffer.create(bad)


def test_existing_and_missing_names(shm_name, no_leaks):
    with SharedBuffer.create(4096, shm_name):
        with pytest.raises(FileExistsError):
            SharedBuffer.create(4096, shm_name)
    with pytest.raises(FileNotFoundError):
        SharedBuffer.open(shm_name)


def test_open_refuses_foreign_permissions(shm_name, no_leaks):
    fd = _ffi.libc.shm_open("/" + shm_name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.ftruncate(fd, 4096)
        with pytest.raises(PermissionError, match="0600"):
            SharedBuffer.open(shm_name)
    finally:
        os.close(fd)
        _ffi.libc.shm_unlink("/" + shm_name)


def test_open_checks_expected_size(shm_name, no_leaks):
    with SharedBuffer.create(8192, shm_name):
        with pytest.raises(ValueError, match="expected 4096"):
            SharedBuffer.open(shm_name, expect_size=4096)


def test_close_unlink_semantics(shm_name, no_leaks):
    a = SharedBuffer.create(8192, shm_name)
    b = SharedBuffer.open(shm_name)
    with pytest.raises(PermissionError, match="creator"):
        b.unlink()
    a.buf[0] = 7
    assert b.buf[0] == 7
    a.unlink()
    assert not os.path.exists(f"/dev/shm/{shm_name}")
    assert b.buf[0] == 7  # mappings outlive the name
    b.close()
    b.close()  # idempotent
    with pytest.raises(ClosedError):
        _ = b.buf
    a.close()


def test_close_with_live_view_is_busy_and_recoverable(no_leaks):
    b = SharedBuffer.create(8192)
    arr = np.frombuffer(b.buf, dtype=np.uint8)
    with pytest.raises(BusyError, match="exported views"):
        b.close()
    assert not b.closed
    arr[0] = 3
    del arr
    b.close()
    b.unlink()


def test_a_view_only_garbage_holds_does_not_make_close_busy(no_leaks):
    """The teardown race of a caught exception: its frames (a reference cycle) hold a view
    of the buffer until the cyclic collector runs, which may be later than close(). close()
    collects once before it says busy. Made to happen with the collector off."""
    import gc

    b = SharedBuffer.create(8192)

    def fail_holding_a_view():
        view = np.frombuffer(b.buf, dtype=np.uint8)[:16]  # noqa: F841 (held by the frame)
        raise ValueError("refused")

    try:
        fail_holding_a_view()
    except ValueError as exc:
        err = exc
    cycle = {"err": err}
    cycle["self"] = cycle  # the exception (its traceback, the frame, the view) only in a cycle
    del err, cycle
    was = gc.isenabled()
    gc.disable()
    try:
        b.close()  # BusyError before: the view lived until the next collection
    finally:
        if was:
            gc.enable()
    b.unlink()


def test_finalizer_unlinks_forgotten_owner(no_leaks):
    import gc

    b = SharedBuffer.create(4096)
    name = b.name
    del b
    gc.collect()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_require_pinned_without_cuda_fails_cleanly(monkeypatch, shm_name, no_leaks):
    monkeypatch.setattr(_ffi.cuda, "device_count", lambda: 0)
    with pytest.raises(CudaUnavailableError, match="no CUDA device"):
        SharedBuffer.create(4096, shm_name, require_pinned=True)
    assert not os.path.exists(f"/dev/shm/{shm_name}")


def test_failure_after_shm_open_leaves_nothing(monkeypatch, shm_name, no_leaks):
    def boom(*a, **k):
        raise OSError(5, "injected")

    monkeypatch.setattr("pdkv.buffer.shared._populate", boom)
    with pytest.raises(OSError, match="injected"):
        SharedBuffer.create(1 << 20, shm_name)
    assert not os.path.exists(f"/dev/shm/{shm_name}")


def test_parallel_population_fills_every_page(no_leaks):
    size = (64 << 20) * 3 + 4096
    with SharedBuffer.create(size, populate_threads=4, huge_pages=True) as b:
        arr = np.frombuffer(b.buf, dtype=np.uint8)
        assert arr[::4096].sum() == 0 and arr[-1] == 0
        del arr


def _child_check(name: str, size: int, q) -> None:
    b = SharedBuffer.open(name, expect_size=size)
    arr = np.frombuffer(b.buf, dtype=np.uint8)
    expect = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    ok = bool((arr == expect).all())
    arr[:] = 255 - expect
    del arr
    b.close()
    q.put(ok)


def _child_pickled(buf: SharedBuffer, q) -> None:
    buf.buf[0] = 42
    q.put((buf.owner, buf.name))
    buf.close()


@pytest.mark.multiproc
def test_two_processes_share_bytes_both_ways(no_leaks):
    size = 3 << 20
    ctx = mp.get_context("spawn")
    with SharedBuffer.create(size) as b:
        expect = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        arr = np.frombuffer(b.buf, dtype=np.uint8)
        arr[:] = expect
        q = ctx.Queue()
        p = ctx.Process(target=_child_check, args=(b.name, size, q))
        p.start()
        assert q.get(timeout=60) is True
        p.join(30)
        assert p.exitcode == 0
        assert (arr == 255 - expect).all()
        del arr
        # pickling re-attaches by name in the child, never as owner
        q2 = ctx.Queue()
        p = ctx.Process(target=_child_pickled, args=(b, q2))
        p.start()
        assert q2.get(timeout=60) == (False, b.name)
        p.join(30)
        assert b.buf[0] == 42
        for qq in (q, q2):
            qq.close()
            qq.join_thread()
    assert pickle.loads(pickle.dumps(1)) == 1


@pytest.mark.multiproc
def test_killed_creator_segment_is_cleaned(no_leaks):
    code = (
        "import sys, time; from pdkv import SharedBuffer; b = SharedBuffer.create(65536); "
        "print(b.name, flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = p.stdout.readline().strip()
        assert name.startswith(f"pdkv-{p.pid}-")
        seg = {s.name: s for s in scan_segments()}[name]
        assert seg.owner_pid == p.pid and seg.owner_alive and not seg.stale
        assert name not in clean_segments(dry_run=False, tag=TAG)  # owner alive: kept
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        p.stdout.close()
    seg = {s.name: s for s in scan_segments()}[name]
    assert seg.stale
    assert name in clean_segments(dry_run=True, tag=TAG)
    assert os.path.exists(f"/dev/shm/{name}")  # dry run removes nothing
    assert name in clean_segments(dry_run=False, tag=TAG)
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.multiproc
def test_clean_with_a_tag_removes_only_that_tags_dead_segments(no_leaks):
    """Two killed creators, one under this run's tag and one under another: a clean with
    the tag removes only the first; the other stays until a clean without a tag."""
    code = (
        "import time; from pdkv import SharedBuffer; b = SharedBuffer.create(65536); "
        "print(b.name, flush=True); time.sleep(60)"
    )
    other = f"x{TAG[1:]}"  # same width, another tag
    names = []
    for tag in (TAG, other):
        p = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PDKV_SHM_TAG=tag)
        )
        try:
            names.append(p.stdout.readline().strip())
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(10)
            p.stdout.close()
    mine, theirs = names
    assert mine.startswith(f"pdkv-{mine.split('-')[1]}-{TAG}") and f"-{other}" in theirs
    try:
        removed = clean_segments(dry_run=False, tag=TAG)
        assert mine in removed and not [f for f in removed if f.startswith(theirs)]
        assert os.path.exists(f"/dev/shm/{theirs}")
        assert shm_main(["clean", "--yes", "--tag", other]) == 0
        assert not os.path.exists(f"/dev/shm/{theirs}")
    finally:
        clean_segments(dry_run=False, tag=other)


@pytest.mark.multiproc
def test_clean_keeps_segments_mapped_by_live_processes(no_leaks):
    # the creator is dead, but this process still maps the buffer: not stale until it closes
    code = (
        "import time; from pdkv import SharedBuffer; b = SharedBuffer.create(65536); "
        "print(b.name, flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = p.stdout.readline().strip()
        b = SharedBuffer.open(name)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        p.stdout.close()
    try:
        seg = {s.name: s for s in scan_segments()}[name]
        assert os.getpid() in seg.mapped_by and not seg.stale and seg.verdict == "live"
        assert name not in clean_segments(dry_run=False, tag=TAG)
    finally:
        b.close()
    assert name in clean_segments(dry_run=False, tag=TAG)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(name)]


def test_cli_list_and_clean(capsys, no_leaks):
    with SharedBuffer.create(4096) as b:
        assert shm_main(["list"]) == 0
        out = capsys.readouterr().out
        assert b.name in out and "live" in out
        assert shm_main(["clean"]) == 0


@pytest.mark.cuda
def test_pinned_buffer_and_cross_process_pin(cuda_device, no_leaks):
    with SharedBuffer.create(64 << 20, require_pinned=True) as b:
        assert b.pinned
        assert b.device_address == b.address  # UVA
        kind, _ = _ffi.cuda.pointer_info(b.address)
        assert kind == "host"
        d = _ffi.cuda.malloc(1 << 20)
        try:
            b.buf[: 1 << 20] = os.urandom(1 << 20)
            _ffi.cuda.memcpy(d, b.address, 1 << 20)
            with SharedBuffer.open(b.name, require_pinned=True) as o:
                assert o.pinned
                _ffi.cuda.memcpy(o.address + (2 << 20), d, 1 << 20)
                assert bytes(o.buf[2 << 20 : 3 << 20]) == bytes(b.buf[: 1 << 20])
        finally:
            _ffi.cuda.free(d)
    assert not b.pinned


def test_full_dev_shm_fails_cleanly(monkeypatch, shm_name, no_leaks):
    import errno as _errno

    def enospc(fd, off, n):
        raise OSError(_errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    with pytest.raises(OSError, match="not enough shared memory"):
        SharedBuffer.create(1 << 20, shm_name)
    assert not os.path.exists(f"/dev/shm/{shm_name}")


def _child_pin_and_copy(name: str, q) -> None:
    from pdkv import _ffi as ffi

    ffi.cuda.set_device(0)
    with SharedBuffer.open(name, require_pinned=True) as b:
        d = ffi.cuda.malloc(1 << 20)
        try:
            ffi.cuda.memcpy(d, b.device_address, 1 << 20)  # mapped pointer, another process
            ffi.cuda.memcpy(b.address + (1 << 20), d, 1 << 20)
        finally:
            ffi.cuda.free(d)
        q.put(b.pinned)


@pytest.mark.cuda
@pytest.mark.multiproc
def test_second_process_pins_the_same_segment(cuda_device, no_leaks):
    ctx = mp.get_context("spawn")
    with SharedBuffer.create(4 << 20, require_pinned=True) as b:
        b.buf[: 1 << 20] = os.urandom(1 << 20)
        q = ctx.Queue()
        p = ctx.Process(target=_child_pin_and_copy, args=(b.name, q))
        p.start()
        assert q.get(timeout=120) is True
        p.join(60)
        assert p.exitcode == 0
        q.close()
        q.join_thread()
        assert bytes(b.buf[1 << 20 : 2 << 20]) == bytes(b.buf[: 1 << 20])


def test_populating_an_open_segment_never_changes_its_data(monkeypatch, shm_name, no_leaks):
    """Even on a kernel without MADV_POPULATE_WRITE (simulated), opening with populate=True
    must not write into a buffer that may hold another process's KV data."""
    from pdkv import _ffi as ffi

    with SharedBuffer.create(3 << 20, shm_name) as b:
        b.buf[:] = b"\x5a" * (3 << 20)
        real = ffi.libc.madvise

        def old_kernel(addr, n, advice):
            if advice == ffi.libc.MADV_POPULATE_WRITE:
                raise OSError(22, "Invalid argument")
            return real(addr, n, advice)

        monkeypatch.setattr(ffi.libc, "madvise", old_kernel)
        with SharedBuffer.open(shm_name, populate=True) as o:
            assert bytes(o.buf[:16]) == b"\x5a" * 16
        assert bytes(b.buf) == b"\x5a" * (3 << 20)


# ---------------------------------------------------------------- striped buffers


@given(size=st.integers(1, 1 << 40), k=st.integers(1, 64))
def test_stripe_sizes_cover_the_buffer_exactly(size, k):
    try:
        sizes = stripe_sizes(size, k)
    except ValueError as exc:
        assert "too many" in str(exc)
        per = -(-size // k)  # each stripe's share, rounded up to whole 2 MiB pages
        assert k > 1 and -(-per // (2 << 20)) * (2 << 20) * (k - 1) >= size
        return
    assert len(sizes) == k and sum(sizes) == size and min(sizes) > 0
    if k > 1:
        assert len(set(sizes[:-1])) == 1 and sizes[0] % (2 << 20) == 0 and sizes[-1] <= sizes[0]


def test_auto_stripes_only_for_large_buffers(monkeypatch):
    from pdkv.buffer.shared import _auto_stripes

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert _auto_stripes(64 << 20) == 1
    assert _auto_stripes(1 << 30) == 4
    assert _auto_stripes(8 << 30) == 8
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert _auto_stripes(8 << 30) == 2


def _child_stripes(name: str, size: int, q) -> None:
    b = SharedBuffer.open(name, expect_size=size, populate=True)
    arr = np.frombuffer(b.buf, dtype=np.uint8)
    expect = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
    ok = bool((arr == expect).all())
    arr[:] = 255 - expect
    del arr
    q.put((ok, b.stripes))
    b.close()


@pytest.mark.multiproc
def test_striped_buffer_is_one_range_shared_across_processes(no_leaks):
    size = (5 << 20) + 12345
    with SharedBuffer.create(size, stripes=3, populate_threads=2) as b:
        assert b.stripes == 3
        assert b.part_names == [b.name, b.name + "@1", b.name + "@2"]
        sizes = [os.stat(f"/dev/shm/{p}").st_size for p in b.part_names]
        assert sizes == [2 << 20, 2 << 20, (1 << 20) + 12345]
        assert all(stat.S_IMODE(os.stat(f"/dev/shm/{p}").st_mode) == 0o600 for p in b.part_names)
        arr = np.frombuffer(b.buf, dtype=np.uint8)
        assert arr.size == size and not arr.any()  # populated and zero across every stripe
        expect = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
        arr[:] = expect
        # the bytes really are in the part files, at their offsets
        with open(f"/dev/shm/{b.name}@1", "rb") as f:
            assert f.read(4096) == expect[2 << 20 : (2 << 20) + 4096].tobytes()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_child_stripes, args=(b.name, size, q))
        p.start()
        assert q.get(timeout=60) == (True, 3)
        p.join(30)
        assert p.exitcode == 0
        q.close()
        q.join_thread()
        assert (arr == 255 - expect).all()
        del arr
        parts = b.part_names
    assert not any(os.path.exists(f"/dev/shm/{p}") for p in parts)


def test_striped_buffer_errors(shm_name, no_leaks):
    with pytest.raises(ValueError, match="too many"):
        SharedBuffer.create(3 << 20, shm_name, stripes=3)
    for bad in (0, 65, 2.0, True):
        with pytest.raises(ValueError, match="stripes="):
            SharedBuffer.create(8 << 20, shm_name, stripes=bad)
    with pytest.raises(ValueError, match="invalid"):
        SharedBuffer.open(shm_name + "@1")  # parts are not names one may open
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(shm_name)]
    # a stripe whose name exists already: nothing of the new buffer is left behind
    fd = _ffi.libc.shm_open(f"/{shm_name}@2", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        with pytest.raises(FileExistsError):
            SharedBuffer.create(6 << 20, shm_name, stripes=3)
        assert sorted(f for f in os.listdir("/dev/shm") if f.startswith(shm_name)) == [f"{shm_name}@2"]
    finally:
        _ffi.libc.shm_unlink(f"/{shm_name}@2")


def test_open_refuses_a_striped_buffer_with_a_missing_or_resized_stripe(shm_name, no_leaks):
    with SharedBuffer.create(7 << 20, shm_name, stripes=4) as b:
        with open(f"/dev/shm/{shm_name}@1", "rb") as f:
            keep = f.read()
        os.unlink(f"/dev/shm/{shm_name}@1")
        with pytest.raises(ValueError, match="missing"):
            SharedBuffer.open(shm_name)
        with open(f"/dev/shm/{shm_name}@1", "wb") as f:
            f.write(keep[: 1 << 20])
        os.chmod(f"/dev/shm/{shm_name}@1", 0o600)
        with pytest.raises(ValueError, match="inconsistent"):
            SharedBuffer.open(shm_name)
        with open(f"/dev/shm/{shm_name}@1", "wb") as f:
            f.write(keep)
        with pytest.raises(ValueError, match="expected"):
            SharedBuffer.open(shm_name, expect_size=8 << 20)
        with SharedBuffer.open(shm_name, expect_size=7 << 20) as o:
            assert o.stripes == 4
        assert b.stripes == 4


def test_striped_population_out_of_room_fails_cleanly(monkeypatch, shm_name, no_leaks):
    import errno as _errno

    real = _ffi.libc.madvise

    def full(addr, n, advice):
        if advice == _ffi.libc.MADV_POPULATE_WRITE:
            raise OSError(_errno.EFAULT, "Bad address")
        return real(addr, n, advice)

    monkeypatch.setattr(_ffi.libc, "madvise", full)
    with pytest.raises(OSError, match="not enough shared memory"):
        SharedBuffer.create(6 << 20, shm_name, stripes=3)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(shm_name)]


def test_killed_creator_stripes_are_all_cleaned(no_leaks):
    code = (
        "import time; from pdkv import SharedBuffer; b = SharedBuffer.create(5 << 20, stripes=3); "
        "print(b.name, flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = p.stdout.readline().strip()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        p.stdout.close()
    parts = [name, name + "@1", name + "@2"]
    assert all(os.path.exists(f"/dev/shm/{x}") for x in parts)
    assert sorted(set(parts) & set(clean_segments(dry_run=False, tag=TAG))) == sorted(parts)
    assert not any(os.path.exists(f"/dev/shm/{x}") for x in parts)


@pytest.mark.cuda
def test_striped_pinned_buffer_copies_across_stripes(cuda_device, no_leaks):
    # one registration over all stripes: copies that span stripe boundaries work
    with SharedBuffer.create(6 << 20, require_pinned=True, stripes=3) as b:
        assert b.pinned and b.device_address == b.address
        n, off = 3 << 20, 1 << 20  # bytes 1..4 MiB: stripes 0, 1 and 2
        data = os.urandom(n)
        b.buf[off : off + n] = data
        d = _ffi.cuda.malloc(n)
        try:
            _ffi.cuda.memcpy(d, b.address + off, n)
            b.buf[off : off + n] = bytes(n)
            _ffi.cuda.memcpy(b.address + (2 << 20) + 7, d, n - 7)
            assert bytes(b.buf[(2 << 20) + 7 : (5 << 20)]) == data[: n - 7]
        finally:
            _ffi.cuda.free(d)


def _shm_mount_options() -> list[str] | None:
    """Options of the /dev/shm mount in effect (the last one listed, where mounts stack)."""
    found = None
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[1] == "/dev/shm":
                found = parts[3].split(",") if parts[2] == "tmpfs" else None
    return found


def test_huge_pages_where_the_mount_allows_them_and_only_there(no_leaks):
    """/dev/shm remounted huge=advise for the test (root only), then put back: a buffer that
    asks gets huge pages whether it has one stripe (created without fallocate, which would
    allocate small pages first) or several, and a process that opens it maps them as huge
    pages too; one that does not ask, and any buffer on a huge=never mount, gets none."""
    opts = _shm_mount_options()
    if os.geteuid() != 0 or opts is None:
        pytest.skip("needs root and a tmpfs /dev/shm to remount it huge=advise")
    if any(o.startswith("huge=") and o != "huge=never" for o in opts):
        pytest.skip(f"/dev/shm is already mounted with {opts}: left as it is")
    size = 8 << 20
    with SharedBuffer.create(size, pin="never", huge_pages=True, stripes=1) as b:
        assert b.huge_pages_bytes == 0  # the default mount ignores the request
    subprocess.run(["mount", "-o", "remount,huge=advise", "/dev/shm"], check=True)
    try:
        for stripes in (1, 2):
            with (
                SharedBuffer.create(size, pin="never", huge_pages=True, stripes=stripes) as b,
                SharedBuffer.create(size, pin="never", stripes=stripes) as plain,
            ):
                assert b.huge_pages_bytes == size, stripes
                assert plain.huge_pages_bytes == 0
                with SharedBuffer.open(b.name, pin="never", populate=True) as o:
                    assert o.huge_pages_bytes == size
    finally:
        subprocess.run(["mount", "-o", "remount,huge=never", "/dev/shm"], check=True)
    assert _shm_mount_options() is not None and not any(
        o.startswith("huge=") and o != "huge=never" for o in _shm_mount_options()
    )
    with pytest.raises(ClosedError):
        _ = b.huge_pages_bytes


# ------------------------------------------------------------------ origin records, memory, exit


def test_clean_never_removes_what_it_cannot_prove_is_pdkvs(no_leaks):
    from pdkv.buffer.sweeper import clean

    # named with this run's tag, so that the clean below (tag=TAG) touches no other test's files
    forged = f"pdkv-999999-{TAG}forged"
    names = [f"pdkv-999999-{TAG}not_a_pdkv_file", forged]
    for n in names:
        fd = _ffi.libc.shm_open("/" + n, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.close(fd)
    # a forged record: right magic, but naming another uid than the file's
    fd = _ffi.libc.shm_open(f"/{forged}@origin", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.write(fd, b'{"magic": "pdkv-shm-origin/1", "name": "%s", "uid": 12345, "pid": 999999}' % forged.encode())
    os.close(fd)
    try:
        rep = clean(dry_run=False, tag=TAG)
        for n in names:
            assert os.path.exists(f"/dev/shm/{n}")
            assert any(k == n for k, _ in rep.skipped), rep.skipped
        assert "no pdkv origin record" in dict(rep.skipped)[names[0]]
    finally:
        for n in names + [f"{forged}@origin"]:
            with contextlib.suppress(FileNotFoundError):
                _ffi.libc.shm_unlink("/" + n)


def _origin(name):
    import json

    with open(f"/dev/shm/{name}@origin") as f:
        return json.load(f)


def test_every_buffer_carries_its_origin_record(no_leaks):
    from pdkv import procs

    with SharedBuffer.create(65536) as b:
        rec = _origin(b.name)
        assert rec["pid"] == os.getpid() and rec["start_time"] == procs.start_time(os.getpid())
        assert rec["pidns"] == procs.pidns() and rec["boot_id"] == procs.boot_id() and rec["uid"] == os.geteuid()
        assert stat.S_IMODE(os.stat(f"/dev/shm/{b.name}@origin").st_mode) == 0o600
        name = b.name
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(name)]  # the record goes with the buffer


def _unshare():
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to make a pid namespace")
    return ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGKILL"]


@pytest.mark.multiproc
def test_clean_from_another_pid_namespace_keeps_live_segments(no_leaks):
    cmd = _unshare()
    with SharedBuffer.create(65536) as b:
        out = subprocess.run(
            [*cmd, sys.executable, "-m", "pdkv.cli.shm_tool", "clean", "--yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert os.path.exists(f"/dev/shm/{b.name}")  # its pid means nothing over there: kept
        assert f"kept {b.name}: " in out.stdout and "cannot be seen" in out.stdout


@pytest.mark.multiproc
def test_clean_sees_a_creator_in_a_child_pid_namespace(no_leaks):
    cmd = _unshare()
    code = (
        "import time; from pdkv import SharedBuffer; b = SharedBuffer.create(65536); "
        "print(b.name, flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([*cmd, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = p.stdout.readline().strip()
        assert _origin(name)["pid"] == 1  # pid 1 of its namespace; some other process here
        from pdkv import procs

        seg = {s.name: s for s in scan_segments()}[name]
        assert seg.verdict == "live", seg  # it maps the buffer; and its record alone proves it alive:
        verdict, why = procs.creator_verdict(_origin(name))
        assert verdict == "alive" and "pid namespace" in why, why
        assert name not in clean_segments(dry_run=False, tag=TAG)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        p.stdout.close()
    wait = time.monotonic() + 10
    while {s.name: s for s in scan_segments()}[name].verdict != "stale":
        assert time.monotonic() < wait
        time.sleep(0.05)
    removed = clean_segments(dry_run=False, tag=TAG)
    assert name in removed and f"{name}@origin" in removed
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(name)]


@pytest.mark.multiproc
def test_clean_goes_on_after_a_file_it_may_not_remove(monkeypatch, no_leaks):
    from pdkv.buffer.sweeper import clean

    code = (
        "import sys; from pdkv import SharedBuffer; bs = [SharedBuffer.create(65536) for _ in range(2)]; "
        "print(' '.join(b.name for b in bs), flush=True); import os; os._exit(0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    a, b = out.stdout.split()
    real = _ffi.libc.shm_unlink

    def unlink(n):
        if n == "/" + a:
            raise PermissionError(1, "Operation not permitted", n)
        return real(n)

    monkeypatch.setattr(_ffi.libc, "shm_unlink", unlink)
    rep = clean(dry_run=False, tag=TAG)  # this run's only: another test's killed peer keeps its segment
    assert b in rep.removed and a not in rep.removed
    assert any(n == a and "could not remove" in why for n, why in rep.skipped)
    monkeypatch.setattr(_ffi.libc, "shm_unlink", real)
    assert a in clean_segments(dry_run=False, tag=TAG)


def test_a_buffer_larger_than_memory_is_refused(monkeypatch, shm_name, no_leaks):
    from pdkv.buffer import segments as shm_mod  # where create() checks memory

    monkeypatch.setattr(shm_mod, "available_memory", lambda: (10 << 30, "MemAvailable"))
    with pytest.raises(OSError, match=r"does not fit in memory: MemAvailable leaves 10737418240 bytes") as e:
        SharedBuffer.create(20 << 30, shm_name)
    assert e.value.errno == errno.ENOMEM and "allow_overcommit" in str(e.value)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(shm_name)]
    monkeypatch.undo()
    # and on this host, for real: more than it has
    avail, where = shm_mod.available_memory()
    with pytest.raises(OSError, match="does not fit in memory"):
        SharedBuffer.create(avail + (1 << 30), shm_name, populate=False)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(shm_name)]
    with SharedBuffer.create(1 << 20, shm_name, allow_overcommit=True):
        pass


@pytest.mark.multiproc
def test_ordinary_endings_leave_no_segment(no_leaks):
    # closed but never unlinked, then a normal exit
    code = "from pdkv import SharedBuffer; b = SharedBuffer.create(65536); print(b.name, flush=True); b.close()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    name = out.stdout.strip()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(name)]
    # SIGTERM inside the creator's with-block
    code = (
        "import time; from pdkv import SharedBuffer\n"
        "with SharedBuffer.create(65536) as b:\n    print(b.name, flush=True); time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = p.stdout.readline().strip()
        assert os.path.exists(f"/dev/shm/{name}")
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == -signal.SIGTERM  # still dies of SIGTERM
    finally:
        reap_proc(p)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(name)]


def reap_proc(p):
    if p.poll() is None:
        p.kill()
        p.wait(10)
    if p.stdout:
        p.stdout.close()


# ---- pdkv.buffer.segments in one process: names, stripes, the memory check, the origin
# record, population and the owned names, each against exact figures

from pdkv.buffer import segments as seg  # noqa: E402


def test_default_name_carries_the_pid_and_a_valid_tag(monkeypatch):
    import re

    for tag, want in (("", ""), ("run7", "run7"), ("x" * 16, "x" * 16), ("x" * 17, ""), ("a-b", ""), ("é", "")):
        monkeypatch.setenv("PDKV_SHM_TAG", tag)
        name = seg.default_name()
        assert re.fullmatch(rf"pdkv-{os.getpid()}-{re.escape(want)}[0-9a-f]{{12}}", name), (tag, name)
        assert seg.validate_name(name) == name
    monkeypatch.delenv("PDKV_SHM_TAG")
    assert seg.default_name() != seg.default_name()


def test_stripes_and_threads_by_cpus_and_size(monkeypatch):
    mib = 1 << 20
    for cpus, size, stripes in ((16, 4096 * mib, 8), (16, 512 * mib, 2), (16, 511 * mib, 1), (16, 1, 1),
                                (3, 4096 * mib, 3), (None, 4096 * mib, 1)):  # fmt: skip
        monkeypatch.setattr(os, "cpu_count", lambda c=cpus: c)
        assert seg._auto_stripes(size) == stripes, (cpus, size)
    for cpus, stripes, threads in ((16, 1, 8), (16, 12, 12), (4, 1, 4), (4, 12, 4), (None, 3, 1)):
        monkeypatch.setattr(os, "cpu_count", lambda c=cpus: c)
        assert seg._default_threads(stripes) == threads, (cpus, stripes)


def _files(tmp_path, **files):
    out = {}
    for key, text in files.items():
        p = tmp_path / key
        p.write_text(text)
        out[key] = str(p)
    return out


def test_available_memory_takes_the_lower_of_meminfo_and_the_cgroup(tmp_path, monkeypatch):
    f = _files(tmp_path, meminfo="MemTotal: 100 kB\nMemAvailable:    2000 kB\n", v2max="max\n", v2cur="5\n",
               v2lim="1500000\n", v1lim="1000000\n", v1use="400000\n", bad="x\n", big="99999999\n")  # fmt: skip
    monkeypatch.setattr(seg, "_MEMINFO", f["meminfo"])
    monkeypatch.setattr(seg, "_CGROUP_FILES", ())
    assert seg.available_memory() == (2000 * 1024, "MemAvailable")
    monkeypatch.setattr(seg, "_CGROUP_FILES", ((f["v2max"], f["v2cur"]),))  # no limit: skipped
    assert seg.available_memory() == (2000 * 1024, "MemAvailable")
    monkeypatch.setattr(seg, "_CGROUP_FILES", ((f["v2lim"], f["v2cur"]), (f["v1lim"], f["v1use"])))
    assert seg.available_memory() == (600000, f"the memory cgroup ({f['v1lim']})")  # the lower of the two cgroups
    monkeypatch.setattr(seg, "_CGROUP_FILES", ((f["v2lim"], f["big"]),))  # over its limit: nothing left
    assert seg.available_memory() == (0, f"the memory cgroup ({f['v2lim']})")
    monkeypatch.setattr(seg, "_CGROUP_FILES", ((f["bad"], f["v2cur"]), (f["v2lim"], str(tmp_path / "none"))))
    assert seg.available_memory() == (2000 * 1024, "MemAvailable")  # unreadable ones are skipped
    monkeypatch.setattr(seg, "_CGROUP_FILES", ((f["big"], f["v2cur"]),))  # a limit above MemAvailable
    assert seg.available_memory() == (2000 * 1024, "MemAvailable")
    monkeypatch.setattr(seg, "_MEMINFO", str(tmp_path / "none"))
    monkeypatch.setattr(seg, "_CGROUP_FILES", ())
    assert seg.available_memory() == (1 << 62, "unknown")
    monkeypatch.setattr(seg, "_MEMINFO", f["bad"])
    assert seg.available_memory() == (1 << 62, "unknown")


def test_check_memory_leaves_a_margin_and_says_how_much(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(seg, "available_memory", lambda: (20 * gib, "MemAvailable"))
    seg._check_memory(18 * gib, "b")  # the margin: a tenth (2 GiB) as it is more than 1 GiB
    with pytest.raises(OSError) as e:
        seg._check_memory(18 * gib + 1, "b")
    assert e.value.errno == errno.ENOMEM and e.value.filename == "b"
    assert e.value.strerror == (
        f"a shared buffer of {18 * gib + 1} bytes (18.00 GiB) does not fit in memory: MemAvailable leaves "
        f"{20 * gib} bytes (20.00 GiB), less a margin of {2 * gib} bytes for the rest of the host; use a smaller "
        "buffer, or pass allow_overcommit=True if that memory will be there"
    )
    monkeypatch.setattr(seg, "available_memory", lambda: (5 * gib, "x"))
    seg._check_memory(4 * gib, "b")  # 1 GiB at least
    with pytest.raises(OSError, match=f"less a margin of {gib} bytes"):
        seg._check_memory(4 * gib + 1, "b")


def test_origin_record_says_who_made_the_buffer(monkeypatch):
    import json

    from pdkv import procs

    t = time.time()
    rec = json.loads(seg._origin_record("pdkv-x", 4096, 3))
    assert rec.pop("created") == pytest.approx(t, abs=5)
    assert rec == {
        "magic": "pdkv-shm-origin/1", "name": "pdkv-x", "size": 4096, "stripes": 3, "uid": os.geteuid(),
        "boot_id": procs.boot_id(), "pidns": procs.pidns(), "pid": os.getpid(),
        "start_time": procs.start_time(os.getpid()),
    }  # fmt: skip


def test_populate_hands_chunks_round_robin_over_stripes(monkeypatch):
    chunk = seg._POPULATE_CHUNK
    calls = []
    monkeypatch.setattr(_ffi.libc, "madvise", lambda a, n, advice: calls.append((a, n, advice)))
    seg._populate(1000, 3 * chunk, 1, stripes=[2 * chunk, chunk - 7, 7])
    assert calls == [
        (1000, chunk, _ffi.libc.MADV_POPULATE_WRITE),
        (1000 + 2 * chunk, chunk - 7, _ffi.libc.MADV_POPULATE_WRITE),
        (1000 + 3 * chunk - 7, 7, _ffi.libc.MADV_POPULATE_WRITE),
        (1000 + chunk, chunk, _ffi.libc.MADV_POPULATE_WRITE),
    ]
    calls.clear()
    seg._populate(0, chunk + 1, 8)  # one file: two chunks, the last one byte
    assert sorted(calls) == [(0, chunk, _ffi.libc.MADV_POPULATE_WRITE), (chunk, 1, _ffi.libc.MADV_POPULATE_WRITE)]


def test_populate_without_madv_populate_write_writes_only_fresh_segments(monkeypatch):
    def einval(a, n, advice):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(_ffi.libc, "madvise", einval)
    buf = np.full(3 * 4096, 7, np.uint8)
    seg._populate(buf.ctypes.data, buf.size, 2, fresh=False)  # read only: an existing segment's data stays
    assert (buf == 7).all()
    seg._populate(buf.ctypes.data, buf.size, 2, fresh=True)  # a fresh one is zero anyway: memset
    assert (buf == 0).all()


def test_populate_reports_the_first_error_and_stops(monkeypatch):
    chunk = seg._POPULATE_CHUNK
    seen = []

    def fail(a, n, advice):
        seen.append(a)
        raise OSError(errno.ENOMEM, "no memory")

    monkeypatch.setattr(_ffi.libc, "madvise", fail)
    for threads in (1, 4):
        seen.clear()
        with pytest.raises(OSError) as e:
            seg._populate(0, 8 * chunk, threads)
        assert e.value.errno == errno.ENOMEM and 1 <= len(seen) <= threads  # no chunk after an error


def test_owned_names_are_unlinked_once_by_their_process(monkeypatch):
    gone = []
    monkeypatch.setattr(_ffi.libc, "shm_unlink", lambda n: gone.append(n))
    monkeypatch.setattr(seg, "_OWNED", {})
    seg._own("a", ["a", "a@1"])
    seg._own("b", ["b"])
    seg._OWNED["forked"] = (os.getpid() + 1, ["f"])  # a parent's, seen in a forked child: not ours
    seg._disown("b")
    seg._unlink_owned()
    assert gone == ["/a", "/a@1"] and seg._OWNED == {}
    seg._unlink_owned()
    assert gone == ["/a", "/a@1"]

    def missing(n):
        raise FileNotFoundError(n)

    monkeypatch.setattr(_ffi.libc, "shm_unlink", missing)
    seg._own("c", ["c", "c@1"])
    seg._unlink_owned()  # already gone: nothing raised
    assert seg._OWNED == {}


def test_sigterm_unlinks_then_dies_of_sigterm(monkeypatch):
    gone, sent, handlers = [], [], {}
    monkeypatch.setattr(_ffi.libc, "shm_unlink", lambda n: gone.append(n))
    monkeypatch.setattr(seg, "_OWNED", {"x": (os.getpid(), ["x"])})
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(signal, "signal", lambda sig, h: handlers.__setitem__(sig, h))
    seg._on_sigterm(signal.SIGTERM, None)
    assert gone == ["/x"] and handlers == {signal.SIGTERM: signal.SIG_DFL} and sent == [(os.getpid(), signal.SIGTERM)]


def test_sigterm_landing_while_this_thread_holds_the_owned_lock_does_not_hang(monkeypatch):
    """The handler runs on the main thread between bytecodes, possibly inside _own's or
    _disown's critical section: it must not wait for a lock its own thread holds."""
    gone, sent = [], []
    monkeypatch.setattr(_ffi.libc, "shm_unlink", lambda n: gone.append(n))
    monkeypatch.setattr(seg, "_OWNED", {"x": (os.getpid(), ["x"])})
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(signal, "signal", lambda sig, h: None)
    done = threading.Event()

    def handler_inside_the_lock():
        with seg._OWNED_LOCK:
            seg._on_sigterm(signal.SIGTERM, None)
        done.set()

    t = threading.Thread(target=handler_inside_the_lock, daemon=True)
    t.start()
    assert done.wait(5), "SIGTERM's handler waited for the lock its own thread held"
    assert gone == ["/x"] and sent == [(os.getpid(), signal.SIGTERM)]


def test_own_installs_its_hooks_once_and_keeps_a_programs_sigterm_handler(monkeypatch):
    registered, installed = [], []
    monkeypatch.setattr(seg, "_OWNED", {})
    monkeypatch.setattr(seg, "_HOOKS", [])
    monkeypatch.setattr(seg.atexit, "register", lambda f: registered.append(f))
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_DFL)
    monkeypatch.setattr(signal, "signal", lambda sig, h: installed.append((sig, h)))
    seg._own("a", ["a"])
    seg._own("b", ["b"])
    assert registered == [seg._unlink_owned] and installed == [(signal.SIGTERM, seg._on_sigterm)]
    assert seg._OWNED == {"a": (os.getpid(), ["a"]), "b": (os.getpid(), ["b"])}
    monkeypatch.setattr(seg, "_HOOKS", [])
    registered.clear()
    installed.clear()
    monkeypatch.setattr(signal, "getsignal", lambda sig: print)  # the program's own handler: kept
    seg._own("c", ["c"])
    assert registered == [seg._unlink_owned] and installed == []


def test_stale_note_names_the_dead_processes_buffers(monkeypatch):
    import types

    from pdkv.buffer import sweeper

    gib = 1 << 30
    segs = [
        types.SimpleNamespace(name="pdkv-11-aa01", size=gib, stale=True),
        types.SimpleNamespace(name="pdkv-12-bb02", size=gib // 2, stale=True),
        types.SimpleNamespace(name="pdkv-13-aa03", size=gib, stale=False),  # its creator lives
        types.SimpleNamespace(name="pdkv-14-aa04", size=gib // 4, stale=True),
        types.SimpleNamespace(name="pdkv-15-aa05", size=gib // 4, stale=True),
    ]
    monkeypatch.setattr(sweeper, "scan_segments", lambda: segs)
    monkeypatch.delenv("PDKV_SHM_TAG", raising=False)
    assert sweeper.stale_note() == (
        "4 pdkv buffer(s) left by dead processes hold 2.00 GiB of /dev/shm "
        "(pdkv-11-aa01, pdkv-12-bb02, pdkv-14-aa04, ...): `pdkv-shm clean --yes` removes them"
    )
    monkeypatch.setenv("PDKV_SHM_TAG", "aa")  # this deployment's only
    assert sweeper.stale_note() == (
        "3 pdkv buffer(s) left by dead processes hold 1.50 GiB of /dev/shm "
        "(pdkv-11-aa01, pdkv-14-aa04, pdkv-15-aa05): `pdkv-shm clean --yes --tag aa` removes them"
    )
    monkeypatch.setenv("PDKV_SHM_TAG", "zz")
    assert sweeper.stale_note() is None
    monkeypatch.setenv("PDKV_SHM_TAG", "")  # set but empty: every buffer
    assert sweeper.stale_note().startswith("4 pdkv buffer(s)")
    monkeypatch.setattr(sweeper, "scan_segments", lambda: [segs[2]])
    assert sweeper.stale_note() is None


def _descendants(pid: int) -> list[int]:
    """Every process descended from ``pid`` (by /proc's parent links), as psutil's
    ``children(recursive=True)`` finds them."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        at = todo.pop()
        kids = [c for c, pp in parent.items() if pp == at]
        out += kids
        todo += kids
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("how", ["SIGKILL to the group", "SIGTERM", "close", "every descendant killed"])
def test_a_watched_buffer_is_gone_however_its_process_ends(how, no_leaks):
    """A process makes a buffer and watches it (as vLLM's decode connector does), then is
    killed with its whole process group, or ends on SIGTERM's default action, or closes the
    buffer itself, or is killed with every process descended from it (vLLM's server does
    that to its engine core on shutdown): the buffer is gone within the watcher's bound in
    every case."""
    import json
    import signal
    import subprocess
    import sys
    import time

    code = (
        "import json, sys, time\n"
        "from pdkv import SharedBuffer\n"
        "from pdkv.buffer import reaper\n"
        "b = SharedBuffer.create(1 << 20)\n"
        "w = reaper.watch([b.name])\n"
        "print(json.dumps(b.name), flush=True)\n"
        "if sys.stdin.readline().strip() == 'close':\n"
        "    b.close(); b.unlink(); w.close()\n"
        "else:\n"
        "    time.sleep(60)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        name = json.loads(p.stdout.readline())
        assert os.path.exists(f"/dev/shm/{name}")
        if how == "close":
            p.stdin.write("close\n")
            p.stdin.flush()
        elif how == "SIGTERM":
            p.send_signal(signal.SIGTERM)
        elif how == "every descendant killed":
            for pid in _descendants(p.pid):
                os.kill(pid, signal.SIGKILL)
            p.kill()
        else:
            os.killpg(p.pid, signal.SIGKILL)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:  # say where it is stuck: its state, signals, kernel wait
            with open(f"/proc/{p.pid}/status") as f:
                status = [ln.strip() for ln in f if ln.startswith(("State", "Sig", "ShdPnd", "Threads"))]
            with open(f"/proc/{p.pid}/wchan") as f:
                wchan = f.read()
            raise AssertionError(f"the process outlived {how} by 30 s: {status}, waiting in {wchan!r}") from None
        deadline = time.monotonic() + 15
        while any(n.startswith(name) for n in os.listdir("/dev/shm")):
            assert time.monotonic() < deadline, f"{name} is still in /dev/shm ({how})"
            time.sleep(0.1)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdin.close()
        p.stdout.close()
