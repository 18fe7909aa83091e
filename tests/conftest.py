from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
# tools/mutation.py (mutmut sets MUTANT_UNDER_TEST): the same examples, but a failure is
# reported as found, unshrunk, and not saved: a killed mutant should cost seconds
settings.register_profile(
    "mutation", parent=settings.get_profile("ci"), database=None, phases=[Phase.explicit, Phase.reuse, Phase.generate]
)
settings.load_profile("mutation" if os.environ.get("MUTANT_UNDER_TEST") else "ci")


# segments made by this test run (and the processes it starts) carry this tag, so the
# leak checks ignore whatever else runs on the host
# (fixed width: one worker's tag is never the start of another's)
TAG = f"t{os.getpid():07d}"
os.environ["PDKV_SHM_TAG"] = TAG


def _pdkv_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("pdkv") and f"-{TAG}" in n}
    except FileNotFoundError:
        return set()


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fds() -> dict[str, str]:
    """Open descriptors and what each names (a socket, a pipe, a file)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            pass
    return out


@pytest.fixture(scope="session", autouse=True)
def _no_leaks_over_the_session():
    """After the whole suite: no pdkv segment this run made is left behind."""
    before = _pdkv_segments()
    yield
    leaked = _pdkv_segments() - before
    assert not leaked, f"shared-memory segments leaked by the test suite: {sorted(leaked)}"


_CUDA_WARM: list[bool] = []


def _warm_cuda() -> None:
    """On a host with GPUs, make every device's context once, before any fd snapshot: a
    buffer pinned inside a test (``pin="auto"``) would otherwise create the first context
    there, and the driver's files would read as leaked descriptors. Likewise NIXL's first
    agent, where NIXL is installed."""
    if _CUDA_WARM:
        return
    from pdkv import _ffi

    n = _ffi.cuda.device_count()  # 0 without bindings or driver; other failures raise
    _CUDA_WARM.append(True)
    for d in range(n):
        with _ffi.cuda.on_device(d):
            _ffi.cuda.free(_ffi.cuda.malloc(1 << 20))
    if n:
        _ffi.cuda.set_device(0)
    if n and _ffi.nixl.available():
        # NIXL's UCX, on a host with GPUs, opens the driver (its own context: an eventfd and
        # the /dev/nvidia* files) with its first agent and keeps it for the process; an agent
        # of a later test's own must not read as leaked. A per-agent leak still shows.
        _ffi.nixl.Agent(f"pdkv-warm-{os.getpid()}").close()


@pytest.fixture
def no_leaks():
    """Per test: pdkv segments and open fds unchanged (STYLE.md D4)."""
    import gc
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # its one pipe is process-wide, not a leak
    _warm_cuda()
    before_segs, before_fds, named = _pdkv_segments(), _fd_count(), _fds()
    yield
    # sockets of stopped threads close asynchronously: allow a bounded moment
    import time

    deadline = time.monotonic() + 3
    while True:
        gc.collect()
        leaked_segs = _pdkv_segments() - before_segs
        fds = _fd_count()
        if (not leaked_segs and fds <= before_fds) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert leaked_segs == set()
    if fds > before_fds:
        new = {fd: what for fd, what in _fds().items() if named.get(fd) != what}
        raise AssertionError(f"{fds - before_fds} file descriptors leaked: {new}")


@pytest.fixture(scope="session")
def cuda_device() -> int:
    pytest.importorskip("cuda.bindings")
    from pdkv import _ffi

    if _ffi.cuda.device_count() == 0:  # absent statuses map to 0; all others raise
        pytest.skip("no CUDA device")
    _warm_cuda()  # every device's context made now, once (see _warm_cuda)
    return 0


@pytest.fixture
def shm_name(request) -> str:
    import uuid

    return f"pdkv-{os.getpid()}-{TAG}{uuid.uuid4().hex[:8]}"


# hardware probes run when a test asks for them, not when its module is imported


@pytest.fixture
def stream_copy():
    """The streaming copy loop of ``_ffi.cpu``; skips where it does not build (where
    llvmlite is installed, tests/test_cpu_copy.py fails instead, so a broken build shows)."""
    from pdkv._ffi import cpu

    if not cpu.available():
        pytest.skip(f"streaming copy loop unavailable: {cpu.unavailable_reason()}")


@pytest.fixture
def no_rdma_device():
    """A host without an RDMA device (tests of the clear "no RDMA device" errors)."""
    from pdkv import _ffi

    if _ffi.verbs.rdma_devices():
        pytest.skip("this host has an RDMA device")
