"""Named POSIX shared-memory buffer, populated fast and pinned for CUDA when a GPU exists.

The decode instance creates it; prefill processes on the same host (and the decode's own
worker processes) open it by name. Pinning (``cudaHostRegister``, portable + mapped) lets
the swap engine's kernels read it directly; on a CPU-only host it works unpinned.
"""

from __future__ import annotations

import errno
import gc
import logging
import mmap
import os
import stat
import weakref
from contextlib import ExitStack
from typing import Any

from .. import _ffi
from ..errors import BusyError, ClosedError, CudaUnavailableError, PdkvError
from .segments import (
    _MAX_STRIPES,
    NAME_PREFIX,
    ORIGIN_MAGIC,
    ORIGIN_SUFFIX,
    PinMode,
    _auto_stripes,
    _check_memory,
    _default_threads,
    _disown,
    _origin_record,
    _own,
    _populate,
    available_memory,
    default_name,
    part_name,
    read_origin,
    stripe_sizes,
    validate_name,
)

__all__ = [
    "SharedBuffer",
    "default_name",
    "validate_name",
    "NAME_PREFIX",
    "ORIGIN_SUFFIX",
    "ORIGIN_MAGIC",
    "read_origin",
    "available_memory",
]


def _release(mm: mmap.mmap | None, names: list[str] | None, pinned_addr: int | None) -> None:
    # finalizer: raw handles only, never self. Order: unregister, munmap, (unlink)
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
    for name in names or ():
        try:
            _ffi.libc.shm_unlink("/" + name)
        except FileNotFoundError:
            pass
    if names:
        _disown(names[0])


_log = logging.getLogger(__name__)


class SharedBuffer:
    """A named POSIX shared-memory segment, optionally pinned for CUDA.

    Build one with :meth:`create` (owner) or :meth:`open` (attacher). ``buf`` is a
    writable memoryview; ``address`` the first byte's address in this process.

    Ownership: :meth:`close` releases this process's mapping (and CUDA registration);
    :meth:`unlink` removes the name and is allowed to the creator only. The creator's
    ``with`` block does both. A name the creator has not unlinked lives as long as the
    creating process: it is removed when the creator's object is garbage-collected, when
    the process exits, and on SIGTERM (where the program has no SIGTERM handler of its
    own); one killed with SIGKILL leaves it for ``pdkv-shm clean``, which the origin record
    beside it lets prove dead.
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
        self._fin: weakref.finalize[..., SharedBuffer] | None = None
        self.stripes = 1

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
        stripes: int | None = None,
        allow_overcommit: bool = False,
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
            Threads that map the pages in parallel; default ``min(max(8, stripes), cpu
            count)``.
        huge_pages:
            Ask for transparent huge pages (``MADV_HUGEPAGE``) before populating. Takes
            effect only where /dev/shm is a tmpfs mounted with ``huge=advise`` (or
            ``within_size``/``always``, which need no asking); a default mount
            (``huge=never``) ignores it. ``huge_pages_bytes`` tells what was obtained.
        stripes:
            Number of segment files the buffer is striped over (``name``, ``name@1``,
            ...), mapped back to back: one address range, one CUDA registration.
            The kernel fills one file at one thread's speed, so striping is what makes
            parallel population fast (8 GiB on an H200 host: 1.8-2.1 s in one file,
            0.7 s in 8). Default: one stripe per 256 MiB, at most 8 and the cpu count.
        allow_overcommit:
            Skip the memory check: by default a buffer larger than the memory available
            (``MemAvailable`` and the memory cgroup's limit, less the larger of 1 GiB and a
            tenth) is refused, since shared memory that fits /dev/shm but not memory takes
            the whole host down.

        Raises
        ------
        ValueError
            Bad size, name or stripe count.
        FileExistsError
            The name (or one of its stripes' names) exists.
        OSError
            ``ENOSPC``: /dev/shm has too little room; ``ENOMEM``: memory has too little
            (the message names the numbers).
        CudaUnavailableError
            Pinning required but no CUDA device. Nothing is left behind on any failure.
        """
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"size={size!r} must be a positive number of bytes")
        name = validate_name(default_name() if name is None else name)
        mode = _pin_mode(pin, require_pinned)
        if stripes is None:
            stripes = _auto_stripes(size)
        if not isinstance(stripes, int) or isinstance(stripes, bool) or not 1 <= stripes <= _MAX_STRIPES:
            raise ValueError(f"stripes={stripes!r} must be an integer in [1, {_MAX_STRIPES}]")
        sizes = stripe_sizes(size, stripes)
        threads = populate_threads or _default_threads(stripes)
        if not allow_overcommit:
            _check_memory(size, name)
        self = cls(_token=_FACTORY)
        with ExitStack() as undo:
            # owned before its first name exists: a SIGTERM at any point while the parts are
            # made or populated (seconds for a large buffer) removes what exists so far (owned
            # only after the origin record was made, a SIGTERM in between left the record)
            made = [name + ORIGIN_SUFFIX]
            _own(name, made)
            undo.callback(_disown, name)
            # the origin record first: a crash at any later point leaves a buffer clean can prove
            ofd = _ffi.libc.shm_open("/" + name + ORIGIN_SUFFIX, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            undo.callback(_ffi.libc.shm_unlink, "/" + name + ORIGIN_SUFFIX)
            try:
                os.fchmod(ofd, 0o600)
                os.write(ofd, _origin_record(name, size, stripes))
            finally:
                os.close(ofd)
            fds = []
            for i, n in enumerate(sizes):
                part = "/" + part_name(name, i)
                fd = _ffi.libc.shm_open(part, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                made.append(part_name(name, i))
                undo.callback(_ffi.libc.shm_unlink, part)
                undo.callback(os.close, fd)
                os.fchmod(fd, 0o600)  # the umask may only clear bits; be explicit anyway
                os.ftruncate(fd, n)
                fds.append(fd)
            if populate and stripes == 1 and not huge_pages:
                # allocate (and zero) every page now: a full /dev/shm fails here with ENOSPC
                # instead of SIGBUS on first touch, and one fallocate beats faulting pages
                # into one file (8 GiB on an H200 host: 0.94 s, then 0.45 s to map them, vs 1.9 s).
                # Not with huge_pages: fallocate would allocate small pages before the
                # mapping's MADV_HUGEPAGE exists (0 huge pages on a huge=advise tmpfs)
                try:
                    os.posix_fallocate(fds[0], 0, size)
                except OSError as exc:
                    if exc.errno == errno.ENOSPC:
                        raise _no_room(size, name) from None
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
            elif populate:
                # striped (or huge pages): the parallel faulting below allocates the pages
                # (fallocate, which holds each file's inode lock, measured slower); check the
                # room up front
                st = os.statvfs("/dev/shm")
                if st.f_bavail * st.f_frsize < size:
                    raise _no_room(size, name)
            mm = _map(fds, sizes)
            undo.callback(mm.close)
            addr = _ffi.libc.buffer_address(mm)
            if huge_pages:
                try:
                    _ffi.libc.madvise(addr, size, _ffi.libc.MADV_HUGEPAGE)
                except OSError:
                    pass  # advisory: tmpfs without THP support ignores it
            if populate:
                try:
                    _populate(addr, size, threads, stripes=sizes)
                except OSError as exc:
                    # a fault that cannot get a page (tmpfs full since the check, a memory
                    # cgroup limit) makes MADV_POPULATE_WRITE fail with EFAULT or ENOMEM
                    if exc.errno in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC):
                        raise _no_room(size, name) from exc
                    raise
            pinned = _maybe_pin(addr, size, mode)
            if pinned:
                undo.callback(_ffi.cuda.host_unregister, addr)
            self._finish(name, sizes, fds, mm, addr, pinned, owner=True, pin_mode=mode)
            undo.pop_all()
        _own(name, self.owned_names)
        _log.info("created shared buffer %s: %d bytes in %d stripes, pinned=%s", name, size, len(sizes), pinned)
        return self

    @classmethod
    def open(
        cls,
        name: str,
        *,
        pin: PinMode = "auto",
        require_pinned: bool = False,
        expect_size: int | None = None,
        populate: bool = False,
        populate_threads: int | None = None,
    ) -> SharedBuffer:
        """Attach to an existing segment (and its stripes) by name.

        Every stripe must belong to this user and have no group/other permissions.

        Raises
        ------
        FileNotFoundError
            No such name.
        PermissionError
            Owned by another user, or readable by group/others.
        ValueError
            Bad name, inconsistent stripes, or ``expect_size`` differs from the size.

        ``populate=True`` maps every page into this process now, so the first writes
        through it do not pay page faults (a writer that fills the buffer wants this).
        """
        name = validate_name(name)
        mode = _pin_mode(pin, require_pinned)
        self = cls(_token=_FACTORY)
        with ExitStack() as undo:
            fds: list[int] = []
            sizes: list[int] = []
            while len(fds) < _MAX_STRIPES:
                part = part_name(name, len(fds))
                try:
                    fd = _ffi.libc.shm_open("/" + part, os.O_RDWR, 0)
                except FileNotFoundError:
                    if not fds:
                        raise
                    if os.path.exists(f"/dev/shm/{part_name(name, len(fds) + 1)}"):
                        raise ValueError(f"shared memory {name!r}: stripe {part!r} is missing") from None
                    break
                undo.callback(os.close, fd)
                fds.append(fd)
                st = os.fstat(fd)
                if st.st_uid != os.geteuid():
                    raise PermissionError(f"shared memory {part!r} belongs to uid {st.st_uid}, not to this user")
                if stat.S_IMODE(st.st_mode) & 0o077:
                    raise PermissionError(
                        f"shared memory {part!r} has mode {stat.S_IMODE(st.st_mode):o}; pdkv only opens 0600 segments"
                    )
                if st.st_size <= 0:
                    raise ValueError(f"shared memory {part!r} is empty (its creator died while making it?)")
                sizes.append(st.st_size)
            size = sum(sizes)
            try:
                consistent = stripe_sizes(size, len(sizes)) == sizes
            except ValueError:
                consistent = False
            if not consistent:
                raise ValueError(
                    f"shared memory {name!r}: stripes of {sizes} bytes are inconsistent (a stripe missing or resized?)"
                )
            if expect_size is not None and size != expect_size:
                raise ValueError(f"shared memory {name!r} is {size} bytes, expected {expect_size}")
            mm = _map(fds, sizes)
            undo.callback(mm.close)
            addr = _ffi.libc.buffer_address(mm)
            try:  # where the creator got huge pages, map them as such here too (fewer TLB misses)
                _ffi.libc.madvise(addr, size, _ffi.libc.MADV_HUGEPAGE)
            except OSError:
                pass  # advisory
            if populate:
                _populate(addr, size, populate_threads or _default_threads(len(sizes)), fresh=False, stripes=sizes)
            pinned = _maybe_pin(addr, size, mode)
            self._finish(name, sizes, fds, mm, addr, pinned, owner=False, pin_mode=mode)
            undo.pop_all()
        return self

    def _finish(
        self,
        name: str,
        sizes: list[int],
        fds: list[int],
        mm: mmap.mmap,
        addr: int,
        pinned: bool,
        *,
        owner: bool,
        pin_mode: PinMode,
    ) -> None:
        self.name, self.size, self.owner = name, sum(sizes), owner
        self.stripes = len(sizes)
        self._pin_mode = pin_mode
        self._mm, self._addr, self._pinned = mm, addr, pinned
        self._view = memoryview(mm)
        # fds closed right away: the mapping keeps the segments alive, and no fd leaks
        for fd in fds:
            os.close(fd)
        self._fin = weakref.finalize(self, _release, mm, self.owned_names if owner else None, addr if pinned else None)

    @property
    def part_names(self) -> list[str]:
        """Names of the segment files, stripe 0 (``name``) first."""
        return [part_name(self.name, i) for i in range(self.stripes)]

    @property
    def owned_names(self) -> list[str]:
        """What the creator removes: the stripes, then the origin record."""
        return [*self.part_names, self.name + ORIGIN_SUFFIX]

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
    def huge_pages_bytes(self) -> int:
        """Bytes of this process's mapping of the buffer that sit in 2 MiB (PMD) pages, from
        ``/proc/self/smaps`` (``ShmemPmdMapped``); 0 where the kernel gave small pages."""
        self._check()
        lo, hi = self._addr, self._addr + self.size
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line
                    a, b = (int(x, 16) for x in head.split("-"))
                    inside = a < hi and b > lo
                elif inside and head == "ShmemPmdMapped:":
                    total += int(line.split()[1]) * 1024
        return total

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
            try:
                self._mm.close()
            except BufferError:
                # views that only unreachable cycles hold (a caught exception's frames, say)
                # go with a collection; live ones do not
                gc.collect()
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
            self._fin = weakref.finalize(self, _release, self._mm, None, self._addr if self._pinned else None)
        for part in self.owned_names:
            try:
                _ffi.libc.shm_unlink("/" + part)
            except FileNotFoundError:
                pass
        _disown(self.name)

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __reduce__(self) -> tuple[Any, ...]:
        # pickles by name: a child process re-attaches (never the creator's ownership)
        return (_reopen, (self.name, self._pin_mode, self.size))

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("pinned" if self._pinned else "unpinned")
        return f"<SharedBuffer {self.name!r} {self.size} bytes {state}{' owner' if self.owner else ''}>"


_FACTORY = object()


def _no_room(size: int, name: str) -> OSError:
    st = os.statvfs("/dev/shm")
    return OSError(
        errno.ENOSPC,
        f"not enough shared memory for {size} bytes: /dev/shm has {st.f_bavail * st.f_frsize} bytes free",
        name,
    )


def _map(fds: list[int], sizes: list[int]) -> mmap.mmap:
    """One writable shared mapping of the stripes, back to back. Several stripes go into
    an address range reserved by an anonymous ``mmap`` object, each mapped over its part
    with ``MAP_FIXED``: the object's buffer, ``close()`` and export checks then cover them."""
    if len(fds) == 1:
        return mmap.mmap(fds[0], sizes[0], flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mm = mmap.mmap(
        -1,
        sum(sizes),
        flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0x4000),
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )
    try:
        addr = _ffi.libc.buffer_address(mm)
        off = 0
        for fd, n in zip(fds, sizes):
            _ffi.libc.mmap_fixed(addr + off, n, fd)
            off += n
    except BaseException:
        mm.close()
        raise
    return mm


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
