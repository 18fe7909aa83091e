"""Named POSIX shared-memory buffer, populated fast and pinned for CUDA when a GPU exists.

The decode instance creates it; prefill processes on the same host (and the decode's own
worker processes) open it by name. Pinning (``cudaHostRegister``, portable + mapped) lets
the swap engine's kernels read it directly; on a CPU-only host it works unpinned.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import threading
import uuid
import weakref
from contextlib import ExitStack
from typing import Literal

from . import _ffi
from .errors import BusyError, ClosedError, CudaUnavailableError, PdkvError

__all__ = ["SharedBuffer", "default_name", "validate_name", "NAME_PREFIX"]

NAME_PREFIX = "pdkv"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,200}$")
_POPULATE_CHUNK = 64 << 20
PinMode = Literal["auto", "always", "never"]


def default_name() -> str:
    """A name unique per instance, carrying the owner's pid: ``pdkv-<pid>-<tag><random>``.

    ``<tag>`` is ``$PDKV_SHM_TAG`` (letters and digits, at most 16), empty by default: it
    lets a deployment or a test run tell its segments from others on the same host.
    """
    tag = os.environ.get("PDKV_SHM_TAG", "")
    if not (tag.isalnum() and len(tag) <= 16):
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


def _populate(addr: int, size: int, threads: int, *, fresh: bool = True) -> None:
    """Fault in every page of ``[addr, addr+size)`` from ``threads`` threads at once.

    ``MADV_POPULATE_WRITE`` maps the pages writable without changing their content; the
    ctypes call releases the GIL, so threads run in parallel. On kernels without it
    (before 5.14) a ``fresh`` segment is touched with memset (its pages are zero anyway);
    an existing one, which may hold another process's data, is only read page by page.
    """
    chunks = [(off, min(_POPULATE_CHUNK, size - off)) for off in range(0, size, _POPULATE_CHUNK)]
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


def _release(mm: mmap.mmap | None, fd: int, name: str | None, pinned_addr: int | None) -> None:
    # finalizer: raw handles only, never self. Order: unregister, munmap, close, (unlink)
    if pinned_addr is not None:
        try:
            _ffi.cuda.host_unregister(pinned_addr)
        except PdkvError:
            pass
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass  # a view still alive; the mapping goes when the last view does
    if fd >= 0:
        os.close(fd)
    if name is not None:
        try:
            _ffi.libc.shm_unlink("/" + name)
        except FileNotFoundError:
            pass


class SharedBuffer:
    """A named POSIX shared-memory segment, optionally pinned for CUDA.

    Build one with :meth:`create` (owner) or :meth:`open` (attacher). ``buf`` is a
    writable memoryview; ``address`` the first byte's address in this process.

    Ownership: :meth:`close` releases this process's mapping (and CUDA registration);
    :meth:`unlink` removes the name and is allowed to the creator only. A creator that is
    garbage-collected or exits without closing unlinks the name through its finalizer;
    one killed with SIGKILL leaves it for ``pdkv-shm clean``.
    """

    def __init__(self, *, _token: object = None) -> None:
        if _token is not _FACTORY:
            raise TypeError("use SharedBuffer.create(...) or SharedBuffer.open(...)")
        self.name = ""
        self.size = 0
        self.owner = False
        self._pin_mode: PinMode = "never"
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._addr = 0
        self._pinned = False
        self._unlinked = False
        self._fin: weakref.finalize | None = None

    # ------------------------------------------------------------ factories
    @classmethod
    def create(
        cls,
        size: int,
        name: str | None = None,
        *,
        pin: PinMode = "auto",
        require_pinned: bool = False,
        populate: bool = True,
        populate_threads: int | None = None,
        huge_pages: bool = False,
    ) -> SharedBuffer:
        """Create a new segment of ``size`` bytes, mode 0600, ``O_EXCL``.

        Parameters
        ----------
        size:
            Bytes; positive.
        name:
            Segment name without the leading ``/``; default :func:`default_name`.
        pin:
            ``auto``: pin when a CUDA device exists; ``always``: pin or raise;
            ``never``: do not pin.
        require_pinned:
            Same as ``pin="always"``.
        populate:
            Fault in every page now (the receive path must not pay first-touch costs).
        populate_threads:
            Threads that map the pages in parallel; default ``min(8, cpu count)`` (on an
            H200 host 4, 8 and 16 threads took the same time: the kernel serialises).
        huge_pages:
            Ask for transparent huge pages (``MADV_HUGEPAGE``) before populating.

        Raises
        ------
        ValueError
            Bad size or name.
        FileExistsError
            The name exists.
        CudaUnavailableError
            Pinning required but no CUDA device. Nothing is left behind on any failure.
        """
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"size={size!r} must be a positive number of bytes")
        name = validate_name(default_name() if name is None else name)
        mode = _pin_mode(pin, require_pinned)
        self = cls(_token=_FACTORY)
        with ExitStack() as undo:
            fd = _ffi.libc.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            undo.callback(_ffi.libc.shm_unlink, "/" + name)
            undo.callback(os.close, fd)
            os.fchmod(fd, 0o600)  # the umask may only clear bits; be explicit anyway
            os.ftruncate(fd, size)
            if populate:
                # allocate (and zero) every page now: a full /dev/shm fails here with ENOSPC
                # instead of SIGBUS on first touch, and one fallocate beats faulting pages
                # in (8 GiB on an H200 host: 0.94 s, then 0.45 s to map them, vs 1.9 s)
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno == errno.ENOSPC:
                        st = os.statvfs("/dev/shm")
                        raise OSError(errno.ENOSPC, f"not enough shared memory for {size} bytes: "
                                      f"/dev/shm has {st.f_bavail * st.f_frsize} bytes free", name) from None
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            undo.callback(mm.close)
            addr = _ffi.libc.buffer_address(mm)
            if huge_pages:
                try:
                    _ffi.libc.madvise(addr, size, _ffi.libc.MADV_HUGEPAGE)
                except OSError:
                    pass  # advisory: tmpfs without THP support ignores it
            if populate:
                _populate(addr, size, populate_threads or min(8, os.cpu_count() or 1))
            pinned = _maybe_pin(addr, size, mode)
            if pinned:
                undo.callback(_ffi.cuda.host_unregister, addr)
            self._finish(name, size, fd, mm, addr, pinned, owner=True, pin_mode=mode)
            undo.pop_all()
        return self

    @classmethod
    def open(cls, name: str, *, pin: PinMode = "auto", require_pinned: bool = False,
             expect_size: int | None = None, populate: bool = False,
             populate_threads: int | None = None) -> SharedBuffer:
        """Attach to an existing segment by name.

        The segment must belong to this user and have no group/other permissions.

        Raises
        ------
        FileNotFoundError
            No such name.
        PermissionError
            Owned by another user, or readable by group/others.
        ValueError
            Bad name, or ``expect_size`` differs from the segment's size.

        ``populate=True`` maps every page into this process now, so the first writes
        through it do not pay page faults (a writer that fills the buffer wants this).
        """
        name = validate_name(name)
        mode = _pin_mode(pin, require_pinned)
        self = cls(_token=_FACTORY)
        with ExitStack() as undo:
            fd = _ffi.libc.shm_open("/" + name, os.O_RDWR, 0)
            undo.callback(os.close, fd)
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise PermissionError(f"shared memory {name!r} belongs to uid {st.st_uid}, not to this user")
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise PermissionError(
                    f"shared memory {name!r} has mode {stat.S_IMODE(st.st_mode):o}; pdkv only opens 0600 segments"
                )
            size = st.st_size
            if size <= 0:
                raise ValueError(f"shared memory {name!r} is empty (its creator died while making it?)")
            if expect_size is not None and size != expect_size:
                raise ValueError(f"shared memory {name!r} is {size} bytes, expected {expect_size}")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            undo.callback(mm.close)
            addr = _ffi.libc.buffer_address(mm)
            if populate:
                _populate(addr, size, populate_threads or min(8, os.cpu_count() or 1), fresh=False)
            pinned = _maybe_pin(addr, size, mode)
            self._finish(name, size, fd, mm, addr, pinned, owner=False, pin_mode=mode)
            undo.pop_all()
        return self

    def _finish(self, name: str, size: int, fd: int, mm: mmap.mmap, addr: int, pinned: bool,
                *, owner: bool, pin_mode: PinMode) -> None:
        self.name, self.size, self.owner = name, size, owner
        self._pin_mode = pin_mode
        self._mm, self._addr, self._pinned = mm, addr, pinned
        self._view = memoryview(mm)
        # fd closed right away: the mapping keeps the segment alive, and no fd leaks
        os.close(fd)
        self._fin = weakref.finalize(self, _release, mm, -1, name if owner else None,
                                     addr if pinned else None)

    # ------------------------------------------------------------ properties
    @property
    def closed(self) -> bool:
        return self._fin is None or not self._fin.alive

    def _check(self) -> None:
        if self.closed:
            raise ClosedError(f"shared buffer {self.name!r} is closed")

    @property
    def buf(self) -> memoryview:
        """Writable view of the whole segment. Drop derived views before :meth:`close`."""
        self._check()
        assert self._view is not None
        return self._view

    @property
    def address(self) -> int:
        self._check()
        return self._addr

    @property
    def pinned(self) -> bool:
        """True when registered with CUDA (page-locked, mapped into the device's space)."""
        return self._pinned and not self.closed

    @property
    def device_address(self) -> int:
        """Device-visible address of the first byte (UVA); requires a pinned buffer."""
        self._check()
        if not self._pinned:
            raise CudaUnavailableError(f"shared buffer {self.name!r} is not pinned")
        return _ffi.cuda.host_device_pointer(self._addr)

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Release this process's mapping and registration. Idempotent.

        Raises
        ------
        BusyError
            Views derived from :attr:`buf` (numpy arrays, memoryview slices) are alive.
        """
        if self.closed:
            return
        assert self._fin is not None and self._mm is not None
        view, self._view = self._view, None
        if view is not None:
            view.release()
        pinned_addr = self._addr if self._pinned else None
        if pinned_addr is not None:
            _ffi.cuda.host_unregister(pinned_addr)
            self._pinned = False
        try:
            self._mm.close()
        except BufferError:
            # a view is still alive: put everything back as it was and say so
            if pinned_addr is not None:
                _ffi.cuda.host_register(pinned_addr, self.size, mapped=True, portable=True)
                self._pinned = True
            self._view = memoryview(self._mm)
            raise BusyError(
                f"shared buffer {self.name!r} still has exported views (numpy arrays, "
                "memoryviews); drop them before close()"
            ) from None
        self._fin.detach()

    def unlink(self) -> None:
        """Remove the name (creator only). Attached mappings stay valid until closed."""
        if not self.owner:
            raise PermissionError(f"only the creator may unlink shared buffer {self.name!r}")
        if self._unlinked:
            return
        self._unlinked = True
        if self._fin is not None and self._fin.alive:
            # the finalizer must no longer unlink: rebuild it without the name
            self._fin.detach()
            self._fin = weakref.finalize(self, _release, self._mm, -1, None,
                                         self._addr if self._pinned else None)
        try:
            _ffi.libc.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __reduce__(self) -> tuple:
        # pickles by name: a child process re-attaches (never the creator's ownership)
        return (_reopen, (self.name, self._pin_mode, self.size))

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("pinned" if self._pinned else "unpinned")
        return f"<SharedBuffer {self.name!r} {self.size} bytes {state}{' owner' if self.owner else ''}>"


_FACTORY = object()


def _reopen(name: str, pin: PinMode, size: int) -> SharedBuffer:
    return SharedBuffer.open(name, pin=pin, expect_size=size)


def _pin_mode(pin: str, require_pinned: bool) -> PinMode:
    if pin not in ("auto", "always", "never"):
        raise ValueError(f"pin={pin!r} must be 'auto', 'always' or 'never'")
    if require_pinned:
        if pin == "never":
            raise ValueError("require_pinned=True contradicts pin='never'")
        return "always"
    return pin  # type: ignore[return-value]


def _maybe_pin(addr: int, size: int, mode: PinMode) -> bool:
    if mode == "never":
        return False
    if _ffi.cuda.device_count() == 0:
        if mode == "always":
            raise CudaUnavailableError(
                "a pinned buffer was required, but this host has no CUDA device "
                "(or no driver / cuda-bindings: pip install 'pdkv[cuda]')"
            )
        return False
    _ffi.cuda.host_register(addr, size, mapped=True, portable=True)
    return True
