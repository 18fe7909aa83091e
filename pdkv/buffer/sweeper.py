"""Finding pdkv shared-memory buffers and removing those provably left by a dead creator
(the library behind ``pdkv-shm``).

Every buffer pdkv creates has an origin record beside it (``<name>@origin``: uid, boot,
pid namespace, pid and the pid's start time). ``clean`` removes a buffer (its stripes
and its record) only when all of these hold: the record is pdkv's and owned by the same
user as every stripe; that user is the caller (or the caller is root); no process visible
from here maps the buffer; and the record proves the creator dead: another boot, or no
process with that pid and start time in its pid namespace, seen from that namespace or
one above it. Anything it cannot prove (no record, another user's, a creator in a pid
namespace invisible from here, a file it may not remove) is skipped and reported, never
removed. The default is a dry run; ``--yes`` removes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass

from .. import _ffi
from ..procs import creator_verdict
from .segments import NAME_PREFIX, ORIGIN_SUFFIX, STRIPE_SEP, read_origin

__all__ = ["SegmentInfo", "CleanReport", "scan_segments", "clean_segments", "clean", "SHM_DIR"]

SHM_DIR = "/dev/shm"


_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One pdkv buffer (all its stripes) as ``pdkv-shm`` sees it.

    ``verdict`` is ``live``, ``stale`` (provably left by a dead creator: the only kind
    clean removes) or ``unproven``; ``why`` says what decided it."""

    name: str
    size: int
    mode: int
    uid: int
    owner_pid: int | None
    owner_alive: bool
    mapped_by: tuple[int, ...]
    files: tuple[str, ...] = ()
    verdict: str = "unproven"
    why: str = ""

    @property
    def stale(self) -> bool:
        return self.verdict == "stale"


@dataclass(frozen=True, slots=True)
class CleanReport:
    """What a clean did: files removed (or that would be, on a dry run), buffers skipped with why."""

    removed: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]


def _mappers(shm_dir: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    prefix = shm_dir.rstrip("/") + "/"
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps", "rb") as f:
                data = f.read()
        except OSError:
            continue
        for line in data.splitlines():
            i = line.find(prefix.encode())
            if i >= 0:
                nm = line[i + len(prefix) :].split(b" ")[0].decode(errors="replace")
                out.setdefault(nm, set()).add(int(entry))
    return out


def _buffer_of(fname: str) -> str:
    """The buffer a file belongs to: ``name``, ``name@3`` and ``name@origin`` all give ``name``."""
    return fname.split(STRIPE_SEP, 1)[0]


def scan_segments(shm_dir: str = SHM_DIR) -> list[SegmentInfo]:
    """Every buffer with files named ``pdkv*`` in ``shm_dir``, with its verdict."""
    try:
        files = sorted(n for n in os.listdir(shm_dir) if n.startswith(NAME_PREFIX))
    except FileNotFoundError:
        return []
    groups: dict[str, list[str]] = {}
    for n in files:
        groups.setdefault(_buffer_of(n), []).append(n)
    maps = _mappers(shm_dir) if files else {}
    me = os.geteuid()
    out = []
    for name, members in groups.items():
        stats = {}
        for m in members:
            try:
                stats[m] = os.lstat(os.path.join(shm_dir, m))
            except OSError:
                continue
        if not stats:
            continue
        data = [m for m in stats if not m.endswith(ORIGIN_SUFFIX)]
        first = stats.get(name) or next(iter(stats.values()))
        mapped = tuple(sorted(set().union(*(maps.get(m, set()) for m in stats))))
        rec = read_origin(name, shm_dir)
        pid = rec.get("pid") if rec else None
        uids = {st.st_uid for st in stats.values()}
        verdict, why = "unproven", ""
        if rec is None:
            why = "no pdkv origin record (not made by pdkv, or by a pdkv before origin records)"
        elif uids != {rec["uid"]}:
            why = f"files owned by uid(s) {sorted(uids)}, the origin record says {rec['uid']}"
        elif me != 0 and rec["uid"] != me:
            why = f"belongs to uid {rec['uid']}"
        elif mapped:
            verdict, why = "live", f"mapped by pid(s) {', '.join(map(str, mapped))}"
        else:
            v, why = creator_verdict(rec)
            verdict = {"alive": "live", "dead": "stale"}.get(v, "unproven")
        out.append(
            SegmentInfo(
                name,
                sum(stats[m].st_size for m in data),
                first.st_mode & 0o777,
                first.st_uid,
                pid if isinstance(pid, int) else None,
                verdict == "live",
                mapped,
                tuple(sorted(stats)),
                verdict,
                why,
            )
        )
    return out


def clean(
    *, dry_run: bool = True, shm_dir: str = SHM_DIR, tag: str | None = None, names: Collection[str] | None = None
) -> CleanReport:
    """Remove the stale buffers (stripes first, the origin record last); report the rest.
    ``tag``: only buffers whose name carries it (``pdkv-<pid>-<tag>...``, from
    ``$PDKV_SHM_TAG`` at creation), so that one deployment or test run cleans its own;
    ``names``: only these buffers."""
    removed: list[str] = []
    skipped: list[tuple[str, str]] = []
    for seg in scan_segments(shm_dir):
        if tag is not None and not has_tag(seg.name, tag):
            continue
        if names is not None and seg.name not in names:
            continue
        if not seg.stale:
            if seg.verdict == "unproven":
                skipped.append((seg.name, seg.why))
            continue
        order = sorted(seg.files, key=lambda f: f.endswith(ORIGIN_SUFFIX))
        if not dry_run:
            _log.info("removing stale buffer %s: %s", seg.name, seg.why)
        failed = False
        for f in order:
            if dry_run:
                removed.append(f)
                continue
            if failed and f.endswith(ORIGIN_SUFFIX):
                break  # a stripe is left: keep the record that proves it stale for the next clean
            try:
                if shm_dir == SHM_DIR:
                    _ffi.libc.shm_unlink("/" + f)
                else:
                    os.unlink(os.path.join(shm_dir, f))
            except FileNotFoundError:
                continue
            except OSError as exc:  # PermissionError and the like: report it, go on with the rest
                skipped.append((f, f"could not remove: {exc.strerror or exc}"))
                failed = True
                continue
            removed.append(f)
    return CleanReport(tuple(removed), tuple(skipped))


def clean_segments(*, dry_run: bool = True, shm_dir: str = SHM_DIR, tag: str | None = None) -> list[str]:
    """Remove stale buffers (``tag``: as :func:`clean`); return the files removed (those
    that would go, on a dry run)."""
    return list(clean(dry_run=dry_run, shm_dir=shm_dir, tag=tag).removed)


def has_tag(name: str, tag: str) -> bool:
    """Whether buffer ``name`` (``pdkv-<pid>-<tag><random>``) was made under ``tag``."""
    parts = name.split("-", 2)
    return len(parts) == 3 and parts[0] == NAME_PREFIX and parts[1].isdigit() and parts[2].startswith(tag)


def stale_note() -> str | None:
    """A line naming the buffers that dead processes left in /dev/shm (a killed run's, of
    this deployment's ``$PDKV_SHM_TAG`` where set), and how to remove them; None when
    there are none. What a decode says as it starts."""
    tag = os.environ.get("PDKV_SHM_TAG")
    stale = [seg for seg in scan_segments() if seg.stale and (not tag or has_tag(seg.name, tag))]
    if not stale:
        return None
    gib = sum(seg.size for seg in stale) / (1 << 30)
    return (
        f"{len(stale)} pdkv buffer(s) left by dead processes hold {gib:.2f} GiB of /dev/shm "
        f"({', '.join(seg.name for seg in stale[:3])}{', ...' if len(stale) > 3 else ''}): "
        f"`pdkv-shm clean --yes{' --tag ' + tag if tag else ''}` removes them"
    )
