"""A/B of the streaming copy's piece order, in one process:
    python docs/perf-logs/scripts/ab_order.py src|dst [bench args]
Ran on commit a2bcfe8 with one uncommitted line more: a module switch _SOURCE_ORDER in
pdkv.transfer, tested in the `if` before the sort of a layer's pieces by source address.
Source order lost on the H200 x2 host and was taken out again, so on later code this
script runs the benchmark unchanged whichever order it is given.
Produced ../h200x2-ab-order-s6-*.log."""
import runpy, sys
import pdkv.transfer as t
t._SOURCE_ORDER = sys.argv[1] == "src"
sys.argv = ["tools/bench_transport.py"] + sys.argv[2:]
sys.path.insert(0, "tools")
runpy.run_path("tools/bench_transport.py", run_name="__main__")
