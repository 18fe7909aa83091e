"""A/B of kernel descriptor placement inside bench_swap: python exp/ab_desc.py host|side ARGS...

Ran against a temporary pdkv.swap._DESC_ON_HOST switch (host: the kernel reads its
descriptors from the pinned staging memory; side: they are uploaded on a side stream).
The side stream won (h200-desc-ab-s3-*.log) and the switch was removed again."""
import runpy, sys
import pdkv.swap as sw
sw._DESC_ON_HOST = sys.argv[1] == "host"
print("descriptors:", sys.argv[1], flush=True)
sys.argv = ["tools/bench_swap.py"] + sys.argv[2:]
runpy.run_path("tools/bench_swap.py", run_name="__main__")
