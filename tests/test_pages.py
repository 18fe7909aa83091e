"""The allocators that place by request, against a model (hypothesis stateful):
:class:`~pdkv.integrations.core.pages.EnginePages` (an engine's own pages) and
:class:`~pdkv.integrations.sglang.staged.StagedPages` (staging blocks for a GPU decode's
designated device pages)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdkv.errors import RequestError
from pdkv.integrations.core.pages import EnginePages
from pdkv.integrations.sglang.staged import StagedPages

PAGES, BLOCKS = 12, 6
RIDS = st.sampled_from([f"r{i}" for i in range(5)])
PAGE_LISTS = st.lists(st.integers(-1, PAGES), min_size=0, max_size=8)


class StagedMachine(RuleBasedStateMachine):
    """Model: each request is designated (its device pages) or held (its staging blocks
    and device pages); a page belongs to at most one of them, a block to at most one
    holder; the device pages go back only with a request's last staging block."""

    def __init__(self) -> None:
        super().__init__()
        self.sp = StagedPages(BLOCKS, PAGES)
        self.designated: dict[str, tuple[int, ...]] = {}
        self.held: dict[str, tuple[list[int], tuple[int, ...]]] = {}  # rid -> (blocks left, pages)

    def _pages_taken(self) -> set[int]:
        out = {p for ps in self.designated.values() for p in ps}
        return out | {p for _, ps in self.held.values() for p in ps}

    @rule(rid=RIDS, pages=PAGE_LISTS)
    def designate(self, rid, pages):
        ok = (
            pages
            and all(0 <= p < PAGES for p in pages)
            and len(set(pages)) == len(pages)
            and len(pages) <= BLOCKS
            and rid not in self.designated
            and rid not in self.held
            and not set(pages) & self._pages_taken()
        )
        if ok:
            self.sp.designate(rid, pages)
            self.designated[rid] = tuple(pages)
        else:
            with pytest.raises(RequestError):
                self.sp.designate(rid, pages)

    @rule(rid=RIDS)
    def withdraw(self, rid):
        assert self.sp.withdraw(rid) == (rid in self.designated)
        self.designated.pop(rid, None)

    @rule(rid=RIDS, delta=st.integers(-1, 1))
    def allocate_for(self, rid, delta):
        want = self.designated.get(rid)
        n = (len(want) if want else 2) + delta
        free = BLOCKS - sum(len(b) for b, _ in self.held.values())
        never = want is None or len(want) != n  # refused for good, not "full for now"
        assert (self.sp.refusal(rid, n) != "") == never
        got = self.sp.try_allocate_for(rid, n)
        if never or n > free:
            assert got is None
            return
        assert got is not None and len(got) == n and len(set(got)) == n
        taken = {b for bs, _ in self.held.values() for b in bs}
        assert not set(got) & taken
        self.held[rid] = (list(got), self.designated.pop(rid))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_some(self, data):
        rid = data.draw(st.sampled_from(sorted(self.held)))
        blocks, pages = self.held[rid]
        k = data.draw(st.integers(1, len(blocks)))
        self.sp.free(blocks[:k])
        del blocks[:k]
        if not blocks:
            del self.held[rid]

    @rule(block=st.integers(0, BLOCKS - 1))
    def free_unheld_is_refused(self, block):
        if any(block in bs for bs, _ in self.held.values()):
            return
        with pytest.raises(RequestError):
            self.sp.free([block])

    @invariant()
    def accounting(self):
        held = sum(len(b) for b, _ in self.held.values())
        assert self.sp.num_held == held and self.sp.num_free == BLOCKS - held
        for rid in (f"r{i}" for i in range(5)):
            assert self.sp.holds(rid) == (rid in self.designated or rid in self.held)


TestStagedPages = StagedMachine.TestCase
TestStagedPages.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_engine_pages_refuse_a_page_of_another_request_and_give_back_exactly():
    pages = EnginePages(8)
    pages.designate("a", [1, 2])
    with pytest.raises(RequestError, match="belong to request 'a'"):
        pages.designate("b", [2, 3])
    assert pages.designated("a") == (1, 2) and pages.designated("b") is None
    assert pages.try_allocate_for("a", 3) is None  # not the count designated
    assert pages.try_allocate_for("a", 2) == [1, 2] and pages.designated("a") is None
    with pytest.raises(RequestError, match="not one request's granted pages"):
        pages.free([1])
    pages.free([1, 2])
    assert not pages.holds("a") and pages.num_free == 8


def test_a_reservation_that_can_never_be_placed_is_refused_and_one_that_fits_overtakes():
    """The staged scheduler (SGLang's GPU decode): a reservation for a request whose device
    pages are not designated is refused at once with its reason (never queued, where it
    would block the queue), and while a large request waits for staging room, a later one
    that fits is granted past it."""
    from pdkv import DecodeScheduler, SchedulerOptions

    sp = StagedPages(BLOCKS, PAGES)
    s = DecodeScheduler(
        num_layers=1,
        gpu=None,
        buffer=sp,
        swap=object(),
        options=SchedulerOptions(bind="engine", on_full="queue", direct_to_gpu=False, queue_timeout_s=30),
    )
    r = s.reserve("ghost", num_blocks=2)
    assert (r.outcome, r.reason) == (
        "rejected",
        "request 'ghost': no pages are designated to it here (unknown, aborted or granted)",
    )
    sp.designate("a", [0, 1, 2, 3])
    assert s.reserve("a", num_blocks=4).outcome == "buffer"
    sp.designate("big", [4, 5, 6, 7])  # needs 4 staging blocks, 2 are free: waits
    assert s.reserve("big", num_blocks=4).outcome == "queued"
    sp.designate("small", [8, 9])
    assert s.reserve("small", num_blocks=2).outcome == "buffer"  # fits now: past the waiting one
    sp.designate("c", [10, 11])
    assert s.reserve("c", num_blocks=3).outcome == "rejected"  # 2 designated, not 3: never
    assert s.request("big").state.value == "queued"


def test_engine_pages_refusals_say_exactly_what_is_wrong():
    """Every refusal of EnginePages names its cause exactly (ids shown: at most 8; a request
    id in a refusal: at most 80 characters), and on_free gets the request and its pages."""
    import pytest

    from pdkv.errors import RequestError
    from pdkv.integrations.core.pages import EnginePages

    for bad in (0, -1, 2.0, "4", True):
        with pytest.raises(ValueError, match=rf"^num_pages={bad!r} must be a positive integer$"):
            EnginePages(bad)
    freed = []
    pages = EnginePages(16, on_free=lambda rid, ids: freed.append((rid, ids)))
    with pytest.raises(RequestError, match=r"^request 'r': pages must be ids in \[0, 16\), got \[\]$"):
        pages.designate("r", [])
    for ids in ([1, 16], [-1], [True], [1.0], list(range(8)) + [99]):
        with pytest.raises(RequestError) as e:
            pages.designate("r", ids)
        assert str(e.value) == f"request 'r': pages must be ids in [0, 16), got {ids[:8]}"
    with pytest.raises(RequestError, match=r"^request 'r': a page is listed twice$"):
        pages.designate("r", [3, 3])
    assert pages.num_free == 16 and pages.designated("r") is None
    pages.designate("r", range(9))
    assert pages.refusal("r", 9) == ""
    long = "x" * 100
    assert pages.refusal(long, 1) == f"request {long[:80]!r}: no pages are designated to it here " + (
        "(unknown, aborted or granted)"
    )
    pages.designate(long, [10])
    assert pages.refusal(long, 2) == f"request {long[:80]!r}: 1 pages are designated to it, not 2"
    got = pages.try_allocate_for("r", 9)
    assert got == list(range(9))
    with pytest.raises(RequestError) as e:
        pages.free([8, 0, 1, 2, 3, 4, 5, 6, 7])
    assert str(e.value) == "pages [8, 0, 1, 2, 3, 4, 5, 6] are not one request's granted pages"
    pages.free(got)
    assert freed == [("r", tuple(range(9)))] and pages.num_free == 15
