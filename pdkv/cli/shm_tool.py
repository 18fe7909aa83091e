"""``pdkv-shm``: list pdkv shared-memory buffers; ``clean`` removes those provably left by a
dead creator (dry run unless ``--yes``). The rules are :mod:`pdkv.buffer.sweeper`'s."""

from __future__ import annotations

import argparse
import sys

from ..buffer.sweeper import clean, scan_segments

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="pdkv-shm",
        description="List pdkv's shared-memory buffers (list); remove those provably left by a dead creator "
        "(clean, a dry run unless --yes).",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list pdkv buffers and what is known of their creators")
    c = sub.add_parser("clean", help="remove buffers provably left by a dead creator (dry run unless --yes)")
    c.add_argument("--yes", action="store_true", help="really remove them")
    c.add_argument("--tag", help="only buffers made under this $PDKV_SHM_TAG (default: every pdkv buffer)")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        segs = scan_segments()
        if not segs:
            print("no pdkv segments")
        for s in segs:
            print(
                f"{s.name}\t{s.size}\tmode={s.mode:o}\towner={s.owner_pid}\t{s.verdict}\t{s.why}"
                f"\tmapped_by={','.join(map(str, s.mapped_by)) or '-'}"
            )
        return 0
    rep = clean(dry_run=not args.yes, tag=args.tag)
    verb = "removed" if args.yes else "would remove"
    for n in rep.removed:
        print(f"{verb} {n}")
    for n, why in rep.skipped:
        print(f"kept {n}: {why}")
    if not rep.removed:
        print("nothing to clean")
    elif not args.yes:
        print("dry run: pass --yes to remove", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
