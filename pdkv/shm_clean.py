"""``pdkv-shm``: list pdkv shared-memory segments and remove those whose owner is dead.

A segment is *stale* when the pid in its name (``pdkv-<pid>-...``) is not running and no
live process maps it. Only stale segments are removed, and only with ``--yes``; the
default is a dry run. A reused pid makes a segment look alive: that errs on keeping it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass

from . import _ffi
from .shm import NAME_PREFIX

__all__ = ["SegmentInfo", "scan_segments", "clean_segments", "pid_alive", "main"]

SHM_DIR = "/dev/shm"
_PID_RE = re.compile(rf"^{NAME_PREFIX}[-_](\d+)[-_]")


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    name: str
    size: int
    mode: int
    uid: int
    owner_pid: int | None
    owner_alive: bool
    mapped_by: tuple[int, ...]

    @property
    def stale(self) -> bool:
        return self.owner_pid is not None and not self.owner_alive and not self.mapped_by


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead; another user's process as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return True


def _mappers(shm_dir: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    prefix = shm_dir.rstrip("/") + "/"
    for entry in os.listdir("/proc"):
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
                nm = line[i + len(prefix):].split(b" ")[0].decode(errors="replace")
                out.setdefault(nm, set()).add(int(entry))
    return out


def scan_segments(shm_dir: str = SHM_DIR) -> list[SegmentInfo]:
    """Every ``pdkv*`` segment with its owner pid, liveness and mapping processes."""
    try:
        names = sorted(n for n in os.listdir(shm_dir) if n.startswith(NAME_PREFIX))
    except FileNotFoundError:
        return []
    maps = _mappers(shm_dir) if names else {}
    out = []
    for n in names:
        try:
            st = os.stat(os.path.join(shm_dir, n))
        except FileNotFoundError:
            continue
        m = _PID_RE.match(n)
        pid = int(m.group(1)) if m else None
        out.append(SegmentInfo(n, st.st_size, st.st_mode & 0o777, st.st_uid, pid,
                               pid_alive(pid) if pid is not None else False,
                               tuple(sorted(maps.get(n, ())))))
    return out


def clean_segments(*, dry_run: bool = True, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove stale segments; return their names (those that would go, on a dry run)."""
    removed = []
    for seg in scan_segments(shm_dir):
        if not seg.stale:
            continue
        if not dry_run:
            try:
                if shm_dir == SHM_DIR:
                    _ffi.libc.shm_unlink("/" + seg.name)
                else:
                    os.unlink(os.path.join(shm_dir, seg.name))
            except FileNotFoundError:
                continue
        removed.append(seg.name)
    return removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdkv-shm", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list pdkv segments")
    c = sub.add_parser("clean", help="remove segments whose owner is dead (dry run unless --yes)")
    c.add_argument("--yes", action="store_true", help="really remove them")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        segs = scan_segments()
        if not segs:
            print("no pdkv segments")
        for s in segs:
            state = "stale" if s.stale else ("live" if s.owner_alive else
                                            "mapped" if s.mapped_by else "unknown-owner")
            print(f"{s.name}\t{s.size}\tmode={s.mode:o}\towner={s.owner_pid}\t{state}"
                  f"\tmapped_by={','.join(map(str, s.mapped_by)) or '-'}")
        return 0
    names = clean_segments(dry_run=not args.yes)
    verb = "removed" if args.yes else "would remove"
    for n in names:
        print(f"{verb} {n}")
    if not names:
        print("nothing to clean")
    elif not args.yes:
        print("dry run: pass --yes to remove", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
