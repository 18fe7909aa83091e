#!/usr/bin/env python3
"""Memory over many requests, the library alone: a DecodeScheduler (block pools, a swap that
completes at once) runs reserve -> every layer landed -> complete -> swap -> ready -> finish
for each request, and this process's RSS is sampled as it goes. What an ended request may
leave behind: its tombstone (``max_tombstones``, 65,536 by default) and its lease's entry in
the expiry heap until the lease falls due. Growth is measured from the sample after the
tombstones filled (the first ``max_tombstones`` requests) to the end, against that point.

    python tools/soak_memory.py [--requests 1000000] [--samples 20] [--lease-s 30]
"""

from __future__ import annotations

import argparse
import json
import resource

from pdkv import BlockPool, DecodeScheduler, SchedulerOptions


class _Done:
    error = None

    def done(self) -> bool:
        return True


class _Swap:
    def submit(self, request_id: str, buffer_blocks: object, gpu_blocks: object) -> _Done:
        return _Done()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / (1 << 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--lease-s", type=float, default=30.0)
    a = ap.parse_args()
    opts = SchedulerOptions(direct_to_gpu=False, lease_s=a.lease_s)
    s = DecodeScheduler(
        num_layers=32, gpu=BlockPool(1024), buffer=BlockPool(1024), swap=_Swap(), tokens_per_block=16, options=opts
    )
    layers = range(32)
    every = max(1, a.requests // a.samples)
    rows: list[tuple[int, float]] = [(0, _rss_mib())]
    for i in range(1, a.requests + 1):
        rid = f"req-{i}"
        r = s.reserve(rid, num_tokens=64)
        assert r.grant is not None
        s.land_layers(rid, r.grant.token, layers)
        s.complete(rid, r.grant.token)
        s.tick()
        for x in s.take_ready():
            s.finish(x.request_id)
        if i % every == 0:
            rows.append((i, _rss_mib()))
    for _ in range(3):  # the last swaps are polled done by the ticks after them
        s.tick()
        for x in s.take_ready():
            s.finish(x.request_id)
    print(f"{'requests':>10} {'RSS MiB':>9}")
    for n, rss in rows:
        print(f"{n:>10,} {rss:>9.1f}")
    full = opts.max_tombstones
    after = [(n, r) for n, r in rows if n >= full]
    base = after[0] if after else rows[-1]
    end = rows[-1]
    growth = (end[1] - base[1]) / base[1] * 100 if base[1] else 0.0
    print(
        f"from {base[0]:,} requests (tombstones full) to {end[0]:,}: {base[1]:.1f} -> {end[1]:.1f} MiB, "
        f"{growth:+.2f} %; live requests at the end: {len(s.live_requests())}"
    )
    print(
        json.dumps(
            {
                "requests": a.requests,
                "rss_mib_start": rows[0][1],
                "rss_mib_tombstones_full": base[1],
                "rss_mib_end": end[1],
                "growth_pct_after_tombstones_full": round(growth, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
