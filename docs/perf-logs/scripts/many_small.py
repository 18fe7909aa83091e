"""Control-plane cost of many small requests: N one-block requests, 4 layers, shm, decode
in this process (dev VM). Reserves with reserve_many and finishes with finish_many where the sender has them.
python docs/perf-logs/scripts/many_small.py [N]"""
import sys, time
sys.path.insert(0, "tests")
import numpy as np
from test_transfer import Decode, prefill_cache
from pdkv.transfer import PrefillSender

N = int(sys.argv[1]) if len(sys.argv) > 1 else 256
dec = Decode(nb=max(64, N))
try:
    lay, arr, spec = prefill_cache(1, 0, nb=max(64, N))
    with PrefillSender(lay, spec, dec.rx.control_address, transport="shm", timeout_s=30) as tx:
        for rep in range(3):
            rids = [f"r{rep}-{i}" for i in range(N)]
            t0 = time.perf_counter()
            if hasattr(tx, "reserve_many"):
                assert all(not isinstance(g, BaseException) for g in tx.reserve_many([(r, 8) for r in rids]))
            else:
                for r in rids:
                    tx.reserve(r, 8)
            t1 = time.perf_counter()
            for layer in range(4):
                tx.send_layer(layer, [(r, [i]) for i, r in enumerate(rids)])
            if hasattr(tx, "finish_many"):
                tx.finish_many(rids)
            else:
                for r in rids:
                    tx.finish(r)
            outs = [tx.wait_outcome(r, 30) for r in rids]
            t2 = time.perf_counter()
            assert all(o.ok for o in outs)
            print(f"N={N}: reserve {1e6*(t1-t0)/N:.0f} us/request, layers+finish+outcome {1e6*(t2-t1)/N:.0f} us/request "
                  f"({1e6*(t2-t1)/(N*5):.0f} us per message-ish)", flush=True)
            time.sleep(0.5)
finally:
    dec.close()
