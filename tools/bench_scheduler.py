#!/usr/bin/env python3
"""Scheduler throughput: full request lifecycles and pool operations per second.

A lifecycle is reserve -> every layer landed -> received -> swap submitted -> swap done
-> ready -> finished, through the buffer path, with pools of 10,000 blocks and 64-block
requests. Layers land one message per layer (as a receiver sees them) and, separately,
in one call. Compared against the engine's budget: a decode step of ~20 ms.

    python tools/bench_scheduler.py [--layers 32] [--requests 20000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdkv import BlockPool, DecodeScheduler, SchedulerOptions


class _Done:
    error = None

    def done(self) -> bool:
        return True


class _InstantSwap:
    _h = _Done()

    def submit(self, rid, buf, gpu):
        return self._h


def lifecycles(n: int, layers: int, per_layer: bool, batch: int = 64) -> float:
    s = DecodeScheduler(
        num_layers=layers,
        gpu=BlockPool(10_000, "gpu"),
        buffer=BlockPool(10_000, "buffer"),
        swap=_InstantSwap(),
        options=SchedulerOptions(direct_to_gpu=False),
    )
    rng = range(layers)
    t0 = time.perf_counter()
    done = 0
    while done < n:
        # a batch of requests in flight at once, as under load
        grants = [s.reserve(f"r{done + i}", num_blocks=64).grant for i in range(batch)]
        for g in grants:
            if per_layer:
                for layer in rng:
                    s.land_layer(g.request_id, g.token, layer)
            else:
                s.land_layers(g.request_id, g.token, rng)
            s.complete(g.request_id, g.token)
        s.tick()  # admits swaps
        s.tick()  # sees them done
        ready = s.take_ready()
        assert len(ready) == batch, len(ready)
        for r in ready:
            s.finish(r.request_id)
        done += batch
    dt = time.perf_counter() - t0
    s.check_invariants()
    assert s.gpu.num_free == 10_000 and s.buffer.num_free == 10_000
    return n / dt


def pool_ops(n: int) -> float:
    p = BlockPool(10_000)
    held = [p.allocate(64) for _ in range(64)]
    t0 = time.perf_counter()
    for i in range(n // 2):
        p.free(held[i % 64])
        held[i % 64] = p.allocate(64)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    lifecycles(2000, a.layers, False)  # warm-up
    bulk = statistics.median(lifecycles(a.requests, a.layers, False) for _ in range(a.reps))
    per = statistics.median(lifecycles(a.requests // 4, a.layers, True) for _ in range(a.reps))
    ops = statistics.median(pool_ops(200_000) for _ in range(a.reps))
    step_budget = 0.020
    print(f"{'what':<52}{'per second':>14}")
    print(f"{'lifecycles, layers landed in one call':<52}{bulk:>14,.0f}")
    print(f"{'lifecycles, one message per layer (' + str(a.layers) + ' layers)':<52}{per:>14,.0f}")
    print(f"{'pool operations (allocate or free 64 blocks)':<52}{ops:>14,.0f}")
    print(
        f"scheduler time per lifecycle: {1e6 / bulk:.1f} us (bulk), {1e6 / per:.1f} us (per layer); "
        f"a 20 ms decode step admits {step_budget * bulk:,.0f} lifecycles"
    )
    print(
        json.dumps(
            {
                "lifecycles_per_s": round(bulk),
                "lifecycles_per_layer_msgs_per_s": round(per),
                "pool_ops_per_s": round(ops),
                "layers": a.layers,
                "target_lifecycles_per_s": 50_000,
            }
        )
    )


if __name__ == "__main__":
    main()
