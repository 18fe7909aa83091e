"""What a pdkv shared-memory segment is on disk: its name and stripes, the origin record
beside it (who made it: the proof ``pdkv-shm clean`` needs), how it is populated, the
memory check before it is made, and the unlinking of owned names at exit or SIGTERM.
:class:`~pdkv.buffer.shared.SharedBuffer` is built on these.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import re
import signal
import stat
import threading
import time
import uuid
from typing import Any, Literal

from .. import _ffi, procs

__all__ = [
    "NAME_PREFIX",
    "STRIPE_SEP",
    "ORIGIN_SUFFIX",
    "ORIGIN_MAGIC",
    "default_name",
    "validate_name",
    "part_name",
    "stripe_sizes",
    "read_origin",
    "available_memory",
]

NAME_PREFIX = "pdkv"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,200}$")
_POPULATE_CHUNK = 64 << 20
# A large buffer is striped over several segment files ("<name>", "<name>@1", ...) mapped
# back to back into one address range. The kernel serialises page allocation per file
# (the page-cache tree and fallocate's inode lock), so one file fills at one thread's
# speed whatever the thread count; k files fill k times in parallel. '@' is not allowed
# in user names, so a part can never collide with another buffer's name.
STRIPE_SEP = "@"
# Beside every buffer it creates, pdkv writes a small origin record "<name>@origin" (0600;
# '@' cannot appear in a user name, so it never collides): who made the buffer (uid, boot,
# pid namespace, pid and its start time). ``pdkv-shm clean`` removes only buffers whose
# record proves them pdkv's and their creator dead.
ORIGIN_SUFFIX = STRIPE_SEP + "origin"
ORIGIN_MAGIC = "pdkv-shm-origin/1"
_ORIGIN_MAX = 4096
# memory left to the host when a buffer is sized: the larger of 1 GiB and a tenth of what is available
_MEM_MARGIN_MIN = 1 << 30
_STRIPE_MIN = 256 << 20  # auto striping: at least this much per stripe
_STRIPE_ALIGN = 2 << 20  # stripes start on huge-page boundaries
_MAX_STRIPES = 64
PinMode = Literal["auto", "always", "never"]


def default_name() -> str:
    """A name unique per instance, carrying the owner's pid: ``pdkv-<pid>-<tag><random>``.

    ``<tag>`` is ``$PDKV_SHM_TAG`` (ASCII letters and digits, at most 16), empty by default: it
    lets a deployment or a test run tell its segments from others on the same host.
    """
    tag = os.environ.get("PDKV_SHM_TAG", "")
    if not (tag.isascii() and tag.isalnum() and len(tag) <= 16):  # "é" is alnum, and no name may hold it
        tag = ""
    return f"{NAME_PREFIX}-{os.getpid()}-{tag}{uuid.uuid4().hex[:12]}"


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid segment name (no slash, 1-201 safe characters)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"shared-memory name {name!r} is invalid: use 1-201 characters from "
            "[A-Za-z0-9_.-], starting with a letter or digit, no '/'"
        )
    return name


def part_name(name: str, index: int) -> str:
    """Name of stripe ``index`` of buffer ``name`` (stripe 0 is ``name`` itself)."""
    return name if index == 0 else f"{name}{STRIPE_SEP}{index}"


def stripe_sizes(size: int, stripes: int) -> list[int]:
    """Sizes of the stripes of a ``size``-byte buffer: all but the last are equal and
    huge-page aligned; raises ``ValueError`` if ``stripes`` would leave one empty."""
    if stripes == 1:
        return [size]
    per = -(-size // stripes)
    per = -(-per // _STRIPE_ALIGN) * _STRIPE_ALIGN
    last = size - per * (stripes - 1)
    if last <= 0:
        raise ValueError(
            f"stripes={stripes} is too many for {size} bytes: stripes are "
            f"{_STRIPE_ALIGN >> 20} MiB-aligned and none may be empty"
        )
    return [per] * (stripes - 1) + [last]


def _auto_stripes(size: int) -> int:
    return max(1, min(8, os.cpu_count() or 1, size // _STRIPE_MIN))


def _default_threads(stripes: int) -> int:
    """Population threads: at least one per stripe, 8 for one file, no more than the cpus."""
    return min(max(8, stripes), os.cpu_count() or 1)


def _populate(addr: int, size: int, threads: int, *, fresh: bool = True, stripes: list[int] | None = None) -> None:
    """Fault in every page of ``[addr, addr+size)`` from ``threads`` threads at once.

    ``MADV_POPULATE_WRITE`` maps the pages writable without changing their content; the
    ctypes call releases the GIL, so threads run in parallel. On kernels without it
    (before 5.14) a ``fresh`` segment is touched with memset (its pages are zero anyway);
    an existing one, which may hold another process's data, is only read page by page.
    With ``stripes`` (sizes of the files mapped back to back) chunks are handed out
    round-robin over the stripes, so that concurrent threads work in different files.
    """
    chunks: list[tuple[int, int]] = []
    off0 = 0
    per_stripe = []
    for n in stripes or [size]:
        per_stripe.append([(off0 + o, min(_POPULATE_CHUNK, n - o)) for o in range(0, n, _POPULATE_CHUNK)])
        off0 += n
    for j in range(max(len(c) for c in per_stripe)):
        chunks.extend(c[j] for c in per_stripe if j < len(c))
    errors: list[BaseException] = []
    lock = threading.Lock()
    it = iter(chunks)

    def work() -> None:
        while True:
            with lock:
                item = next(it, None)
                if item is None or errors:
                    return
            off, n = item
            try:
                try:
                    _ffi.libc.madvise(addr + off, n, _ffi.libc.MADV_POPULATE_WRITE)
                except OSError as exc:
                    if exc.errno != 22:  # EINVAL: kernel without MADV_POPULATE_WRITE
                        raise
                    if fresh:
                        _ffi.libc.memset(addr + off, 0, n)
                    else:  # never write into a segment that may hold data: read a byte a page
                        _ffi.libc.host_view(addr + off, n)[::4096].tobytes()
            except BaseException as exc:  # reported to the caller below
                with lock:
                    errors.append(exc)
                return

    n = max(1, min(threads, len(chunks)))
    if n == 1:
        work()
    else:
        ts = [threading.Thread(target=work, name=f"pdkv-populate-{i}", daemon=True) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    if errors:
        raise errors[0]


def _origin_record(name: str, size: int, stripes: int) -> bytes:
    me = procs.start_time(os.getpid())
    rec = {
        "magic": ORIGIN_MAGIC,
        "name": name,
        "size": size,
        "stripes": stripes,
        "uid": os.geteuid(),
        "boot_id": procs.boot_id(),
        "pidns": procs.pidns(),
        "pid": os.getpid(),
        "start_time": me,
        "created": time.time(),
    }
    return json.dumps(rec, sort_keys=True).encode()


def read_origin(name: str, shm_dir: str = "/dev/shm") -> dict[str, Any] | None:
    """The origin record of buffer ``name`` (a dict), or None when it has none or it is not
    one pdkv wrote (wrong magic, malformed, too large, or not a regular file)."""
    path = os.path.join(shm_dir, name + ORIGIN_SUFFIX)
    try:
        # a FIFO or a device named like a record must not block the sweeper: only a regular
        # file is opened, and without blocking (should it be swapped for a FIFO in between)
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _ORIGIN_MAX:
            return None
        rec = json.loads(os.read(fd, _ORIGIN_MAX))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(rec, dict) or rec.get("magic") != ORIGIN_MAGIC or rec.get("name") != name:
        return None
    if rec.get("uid") != st.st_uid:
        return None  # a record claiming someone else made it
    return rec


_MEMINFO = "/proc/meminfo"
_CGROUP_FILES = (  # (limit, usage) of this process's memory cgroup: v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def available_memory() -> tuple[int, str]:
    """``(bytes, where)``: memory a new buffer may take, the lower of ``MemAvailable`` and what
    this process's memory cgroup (v2 or v1) has left, and which of the two it was."""
    best, where = 1 << 62, "unknown"
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    best, where = int(line.split()[1]) * 1024, "MemAvailable"
                    break
    except (OSError, ValueError):
        pass
    for limit_f, usage_f in _CGROUP_FILES:
        try:
            with open(limit_f) as f:
                raw = f.read().strip()
            if raw == "max":
                continue
            with open(usage_f) as f:
                left = int(raw) - int(f.read().strip())
        except (OSError, ValueError):
            continue
        if left < best:
            best, where = max(0, left), f"the memory cgroup ({limit_f})"
    return best, where


def _check_memory(size: int, name: str) -> None:
    avail, where = available_memory()
    margin = max(_MEM_MARGIN_MIN, avail // 10)
    if size > avail - margin:
        raise OSError(
            errno.ENOMEM,
            f"a shared buffer of {size} bytes ({size / (1 << 30):.2f} GiB) does not fit in "
            f"memory: {where} leaves {avail} bytes ({avail / (1 << 30):.2f} GiB), less a margin of "
            f"{margin} bytes for the rest of the host; use a smaller buffer, or pass "
            "allow_overcommit=True if that memory will be there",
            name,
        )


# Buffers this process created and has not unlinked: removed at exit and on SIGTERM, so a
# process that ends normally or by SIGTERM leaves no segment behind (SIGKILL leaves it for
# pdkv-shm clean). Keyed by name; the pid guards against a forked child removing them.
_OWNED: dict[str, tuple[int, list[str]]] = {}
# reentrant: SIGTERM's handler takes it on the main thread, which may hold it already (in
# _own or _disown) when the signal lands
_OWNED_LOCK = threading.RLock()
_HOOKS: list[bool] = []


def _unlink_owned() -> None:
    with _OWNED_LOCK:
        items = [(n, parts) for n, (pid, parts) in _OWNED.items() if pid == os.getpid()]
        _OWNED.clear()
    for _, parts in items:
        for part in parts:
            try:
                _ffi.libc.shm_unlink("/" + part)
            except OSError:
                pass


def _on_sigterm(signum: int, frame: object) -> None:
    # remove the names, then die of SIGTERM as the default action would (exit status kept)
    _unlink_owned()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _own(name: str, parts: list[str]) -> None:
    with _OWNED_LOCK:
        _OWNED[name] = (os.getpid(), parts)
        if _HOOKS:
            return
        _HOOKS.append(True)
    atexit.register(_unlink_owned)
    # only where SIGTERM would kill the process outright: a handler of the program's own
    # stays (it decides how to end; a with-block or atexit then removes the names)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _disown(name: str) -> None:
    with _OWNED_LOCK:
        _OWNED.pop(name, None)
