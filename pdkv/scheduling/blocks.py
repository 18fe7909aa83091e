"""Block pools with exact accounting.

A pool hands out block ids ``0..num_blocks-1``. Free blocks are kept as runs
(``start -> end``), allocated lowest-first, so a request's blocks come out as few
contiguous runs and copies downstream coalesce. Costs are proportional to the runs an
operation touches, not to the pool size.

Engines bring their own GPU block allocator: pdkv needs only :class:`BlockAllocator`
from it, and :class:`BlockPool` is one implementation.
"""

from __future__ import annotations

import heapq
import numbers
import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..errors import BlockError, OutOfBlocksError
from ..plan import runs_of

__all__ = ["BlockAllocator", "BlockPool", "runs_of"]


@runtime_checkable
class BlockAllocator(Protocol):
    """What pdkv needs from an engine's block allocator.

    ``try_allocate(n)`` returns ``n`` distinct block ids, or ``None`` when fewer than
    ``n`` are free (allocating nothing). ``free(ids)`` returns them. ``num_free`` and
    ``num_total`` count blocks. Implementations must be safe to call from several threads.

    A buffer allocator may also have ``try_allocate_for(request_id, n)``: the scheduler then
    asks it for a request's blocks by name (an engine that chose the pages itself, as
    SGLang's decode does, hands them over this way; ``None`` refuses the request).
    """

    def try_allocate(self, n: int) -> list[int] | None: ...

    def free(self, blocks: Sequence[int]) -> None: ...

    @property
    def num_free(self) -> int: ...

    @property
    def num_total(self) -> int: ...


def _is_id(b: object, n: int) -> bool:
    """``b`` is an integer id (numpy integers too, bools not) in ``[0, n)``."""
    return isinstance(b, numbers.Integral) and not isinstance(b, bool) and 0 <= b < n  # type: ignore[operator]


class BlockPool:
    """A thread-safe pool of ``num_blocks`` blocks.

    Parameters
    ----------
    num_blocks:
        Blocks in the pool; positive.
    name:
        Used in error messages and metrics.

    Ownership: ids from :meth:`allocate` belong to the caller until passed to
    :meth:`free`; a pool never frees on its own.
    """

    def __init__(self, num_blocks: int, name: str = "pool") -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks!r} must be a positive integer")
        self.name = name
        self._n = num_blocks
        self._held = bytearray(num_blocks)  # 1 = held
        self._ids = list(range(num_blocks))  # slices of it are the id lists handed out
        self._ones = memoryview(b"\x01" * num_blocks)
        self._zeros = memoryview(bytes(num_blocks))
        self._starts: dict[int, int] = {0: num_blocks}  # free run start -> stop
        self._ends: dict[int, int] = {num_blocks: 0}  # free run stop -> start
        self._heap: list[int] = [0]  # run starts, lazily deleted
        self._free = num_blocks
        self._lock = threading.Lock()

    @property
    def num_total(self) -> int:
        return self._n

    @property
    def num_free(self) -> int:
        return self._free

    @property
    def num_held(self) -> int:
        return self._n - self._free

    def is_held(self, block: int) -> bool:
        return bool(self._held[block])

    def try_allocate(self, n: int) -> list[int] | None:
        """Allocate ``n`` blocks, lowest ids first; ``None`` (nothing taken) if too few are free."""
        if type(n) is not int or n <= 0:  # an int subclass (not bool) is a count too
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise ValueError(f"{self.name}: cannot allocate n={n!r} blocks (must be a positive integer)")
            n = int(n)
        with self._lock:
            if n > self._free:
                return None
            heap, starts, ends, held = self._heap, self._starts, self._ends, self._held
            s = heap[0]
            e = starts.get(s)
            while e is None:  # drop stale heap entries
                heapq.heappop(heap)
                s = heap[0]
                e = starts.get(s)
            if e - s >= n:  # common case: the lowest free run is long enough
                del starts[s]
                if s + n < e:
                    starts[s + n] = e
                    ends[e] = s + n
                    heapq.heapreplace(heap, s + n)
                else:
                    del ends[e]
                    heapq.heappop(heap)
                held[s : s + n] = self._ones[:n]
                self._free -= n
                return self._ids[s : s + n]
            out: list[int] = []
            need = n
            while need:
                s = heapq.heappop(heap)
                e = starts.get(s)
                if e is None:
                    continue  # stale heap entry
                take = min(need, e - s)
                del starts[s]
                if s + take < e:
                    starts[s + take] = e
                    ends[e] = s + take
                    heapq.heappush(heap, s + take)
                else:
                    del ends[e]
                held[s : s + take] = self._ones[:take]
                out += range(s, s + take)
                need -= take
            self._free -= n
            if len(heap) > 4 * len(starts) + 64:
                self._heap = sorted(starts)
            return out

    def allocate(self, n: int) -> list[int]:
        """Like :meth:`try_allocate`, but raise :class:`OutOfBlocksError` when too few are free."""
        got = self.try_allocate(n)
        if got is None:
            raise OutOfBlocksError(f"{self.name}: asked for {n} blocks, {self._free} of {self._n} free")
        return got

    def free(self, blocks: Sequence[int]) -> None:
        """Return blocks. All are validated first: on a foreign, duplicate or already-free
        id, :class:`BlockError` is raised and nothing changes."""
        if not blocks:
            return
        n = len(blocks)
        first = blocks[0]
        last_id = blocks[-1]
        if (
            type(blocks) is list
            and type(first) is int
            and type(last_id) is int
            and 0 <= first
            and last_id - first == n - 1
            and blocks == self._ids[first : first + n]
            and (n <= 2 or (first >= 2 and type(sum(blocks)) is int) or set(map(type, blocks)) == {int})
        ):
            # the common case, one run as handed out (== alone would take 1.0 for 1: a float,
            # Fraction or Decimal makes the sum one too, 4x cheaper than the types' set, and
            # a bool equals only 0 or 1): validated and merged in one pass
            e = first + n
            with self._lock:
                held = self._held
                if held.count(0, first, e):
                    bad = [b for b in range(first, e) if not held[b]]
                    raise BlockError(f"{self.name}: blocks {bad[:8]} are already free (double free)")
                held[first:e] = self._zeros[:n]
                self._merge(first, e)
                self._free += n
            return
        bad = [b for b in blocks if not _is_id(b, self._n)]
        if bad:  # before any arithmetic on them: a float or a string is a BlockError too
            raise BlockError(f"{self.name}: block ids {bad[:8]} are not in this pool of {self._n}")
        runs = runs_of(blocks)
        if len(runs) > 1:
            runs = runs_of(sorted(blocks))
        with self._lock:
            total = 0
            last = -1
            held = self._held
            for s, e in runs:
                if s < last:
                    raise BlockError(f"{self.name}: duplicate block ids in one free() call")
                last = e
                if held.count(0, s, e):
                    bad = [b for b in range(s, e) if not held[b]]
                    raise BlockError(f"{self.name}: blocks {bad[:8]} are already free (double free)")
                total += e - s
            for s, e in runs:
                held[s:e] = self._zeros[: e - s]
                self._merge(s, e)
            self._free += total

    def _merge(self, s: int, e: int) -> None:
        """Blocks ``[s, e)``, just marked free, joined with the free runs on either side
        (under the lock)."""
        starts, ends = self._starts, self._ends
        left = ends.pop(s, None)
        if left is not None:
            del starts[left]
            s = left
        right = starts.pop(e, None)
        if right is not None:
            del ends[right]
            e = right
        starts[s] = e
        ends[e] = s
        heap = self._heap
        heapq.heappush(heap, s)
        # stale and repeated starts are dropped lazily; a pool that only ever takes its
        # lowest run (the fast path) would otherwise grow its heap by one a free, forever
        if len(heap) > 4 * len(starts) + 64:
            self._heap = sorted(starts)

    def check(self) -> None:
        """Verify internal consistency (tests): runs cover exactly the free blocks, each run
        is maximal (no free run touches another), and every run start is in the heap. Raises
        ``AssertionError`` naming the first inconsistency found (also under ``python -O``)."""
        with self._lock:
            self._check()

    def _check(self) -> None:
        def fail(why: str) -> None:
            raise AssertionError(f"{self.name}: {why}")

        n, held, starts, ends = self._n, self._held, self._starts, self._ends
        marked = held.count(0)
        if marked != self._free:
            fail(f"{marked} blocks are marked free, but the free count is {self._free}")
        if len(ends) != len(starts):
            fail(f"{len(starts)} free runs start but {len(ends)} end")
        heap = set(self._heap)
        for s, e in sorted(starts.items()):
            if not 0 <= s < e <= n:
                fail(f"free run {s}-{e} is empty or outside 0-{n}")
            if ends.get(e) != s:
                fail(f"free run {s}-{e} ends at {e}, which names the run from {ends.get(e)}")
            if any(held[s:e]):
                fail(f"free run {s}-{e} holds held block {s + held[s:e].index(1)}")
            if e in starts:
                fail(f"free runs {s}-{e} and {e}-{starts[e]} are not merged")
            if s > 0 and not held[s - 1]:
                fail(f"free run {s}-{e} is not maximal: block {s - 1} before it is free")
            if e < n and not held[e]:
                fail(f"free run {s}-{e} is not maximal: block {e} after it is free")
            if s not in heap:
                fail(f"free run {s}-{e} missing from the heap")
        covered = sum(e - s for s, e in starts.items())
        if covered != self._free:  # runs disjoint and maximal, so a free block is in no run
            fail(f"free runs cover {covered} blocks, but the free count is {self._free}")

    def __repr__(self) -> str:
        return f"<BlockPool {self.name!r} {self._free}/{self._n} free>"
