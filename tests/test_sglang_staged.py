"""pdkv.integrations.sglang.staged.StagedPages on its own (no SGLang): staging blocks only for
a request SGLang designated device pages for, exactly as many; its device pages released
only when its last staging block is freed (its copy over); against a model. test_sglang.py
drives the same class through SGLang's classes and a real swap."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdkv.errors import RequestError
from pdkv.integrations.sglang.staged import StagedPages

RIDS = st.sampled_from(["r0", "r1", "r2", "r3"])


def test_a_request_gets_staging_blocks_only_for_its_designated_pages():
    sp = StagedPages(8, 16)
    assert (sp.num_total, sp.num_free, sp.num_held) == (8, 8, 0)
    assert sp.try_allocate(2) is None and sp.try_allocate_for("a", 2) is None  # nothing designated
    assert sp.refusal("a", 2) == "request 'a': no pages are designated to it here (unknown, aborted or granted)"
    sp.designate("a", [3, 5])
    assert sp.holds("a") and sp.refusal("a", 2) == ""
    assert sp.refusal("a", 3) == "request 'a': 2 pages are designated to it, not 3"
    assert sp.try_allocate_for("a", 3) is None and sp.num_free == 8  # another count: nothing
    blocks = sp.try_allocate_for("a", 2)
    assert blocks is not None and len(blocks) == 2 and len(set(blocks)) == 2
    assert (sp.num_free, sp.num_held) == (6, 2) and sp.holds("a")
    assert sp.try_allocate_for("a", 2) is None  # granted once
    sp.free(blocks[:1])  # the copy still runs: its pages stay
    assert sp.holds("a") and (sp.num_free, sp.num_held) == (7, 1)
    with pytest.raises(RequestError) as e:
        sp.designate("b", [5])
    assert str(e.value) == "request 'b': pages [5] belong to request 'a'"
    sp.free(blocks[1:])
    assert not sp.holds("a") and (sp.num_free, sp.num_held) == (8, 0)
    sp.designate("b", [5, 3])  # the pages are free again
    assert sp.try_allocate_for("b", 2) is not None


def test_a_full_buffer_grants_nothing_and_keeps_the_designation():
    sp = StagedPages(3, 16)
    sp.designate("a", [0, 1])
    sp.designate("b", [2, 3])
    a = sp.try_allocate_for("a", 2)
    assert a is not None
    assert sp.try_allocate_for("b", 2) is None and sp.holds("b") and sp.num_free == 1
    sp.free(a)
    assert sp.try_allocate_for("b", 2) is not None


def test_more_pages_than_the_buffer_is_refused_naming_the_setting():
    sp = StagedPages(4, 64)
    sp.designate("a", [0, 1, 2, 3])  # exactly the buffer: accepted
    with pytest.raises(RequestError) as e:
        sp.designate("b", list(range(4, 9)))
    assert str(e.value) == ("request 'b': 5 pages, more than the staging buffer's 4 (raise PDKV_SGLANG_STAGING_MB)")
    assert not sp.holds("b")


def test_withdraw_drops_a_designation_never_granted():
    sp = StagedPages(4, 8)
    assert sp.withdraw("a") is False
    sp.designate("a", [1])
    assert sp.withdraw("a") is True and not sp.holds("a")
    assert sp.try_allocate_for("a", 1) is None
    sp.designate("b", [1])  # its page is free again
    assert sp.try_allocate_for("b", 1) is not None
    assert sp.withdraw("b") is False  # granted: the scheduler frees it


@pytest.mark.parametrize("bad", [[99], [0, 0], [0, 1, 0], list(range(90, 100))])
def test_freeing_blocks_not_held_is_refused_and_changes_nothing(bad):
    sp = StagedPages(4, 8)
    sp.designate("a", [1, 2])
    blocks = sp.try_allocate_for("a", 2)
    assert blocks is not None
    ids = [blocks[0] if b == 0 else b for b in bad]
    with pytest.raises(RequestError) as e:
        sp.free(ids)
    assert str(e.value) == f"staging blocks {ids[:8]} are not held"
    assert (sp.num_free, sp.num_held) == (2, 2) and sp.holds("a")
    sp.free(blocks)
    assert sp.num_free == 4 and not sp.holds("a")


class StagedMachine(RuleBasedStateMachine):
    """Designations, grants and frees in any order against a model: a request's blocks
    are its own, its pages are released exactly when its last block is freed, and the
    counts always agree."""

    def __init__(self):
        super().__init__()
        self.sp = StagedPages(6, 12)
        self.designated: dict[str, list[int]] = {}
        self.granted: dict[str, list[int]] = {}  # request -> blocks not freed yet
        self.pages_of: dict[str, list[int]] = {}  # granted request -> its pages

    def _busy_pages(self):
        return {p for v in self.designated.values() for p in v} | {p for v in self.pages_of.values() for p in v}

    @rule(rid=RIDS, pages=st.lists(st.integers(0, 11), min_size=1, max_size=7, unique=True))
    def designate(self, rid, pages):
        live = rid in self.designated or rid in self.pages_of
        clash = bool(set(pages) & self._busy_pages())
        if live or clash or len(pages) > 6:
            with pytest.raises(RequestError):
                self.sp.designate(rid, pages)
        else:
            self.sp.designate(rid, pages)
            self.designated[rid] = list(pages)

    @rule(rid=RIDS, extra=st.integers(-1, 1))
    def grant(self, rid, extra):
        want = self.designated.get(rid)
        n = (len(want) if want else 1) + extra
        got = self.sp.try_allocate_for(rid, n)
        free = 6 - sum(len(v) for v in self.granted.values())
        if want is None or n != len(want) or n > free:
            assert got is None
            return
        assert got is not None and len(got) == n
        assert not set(got) & {b for v in self.granted.values() for b in v}
        self.granted[rid] = list(got)
        self.pages_of[rid] = self.designated.pop(rid)

    @precondition(lambda self: self.granted)
    @rule(data=st.data())
    def free_some(self, data):
        rid = data.draw(st.sampled_from(sorted(self.granted)))
        blocks = self.granted[rid]
        k = data.draw(st.integers(1, len(blocks)))
        self.sp.free(blocks[:k])
        self.granted[rid] = blocks[k:]
        if not self.granted[rid]:
            del self.granted[rid]
            del self.pages_of[rid]

    @rule(rid=RIDS)
    def withdraw(self, rid):
        assert self.sp.withdraw(rid) is (rid in self.designated)
        self.designated.pop(rid, None)

    @invariant()
    def agrees(self):
        held = sum(len(v) for v in self.granted.values())
        assert (self.sp.num_held, self.sp.num_free, self.sp.num_total) == (held, 6 - held, 6)
        for rid in ("r0", "r1", "r2", "r3"):
            assert self.sp.holds(rid) is (rid in self.designated or rid in self.pages_of)


TestStaged = StagedMachine.TestCase
TestStaged.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
