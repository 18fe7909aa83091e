#!/usr/bin/env python3
"""A minimal decode loop: the KV cache is a list of torch (or paddle) tensors, one K and
one V per layer, [blocks, heads, tokens, head_dim]. pdkv receives prefill's KV into its
CPU buffer and swaps it into these tensors; the 'engine' then decodes (here: checks the
first value and finishes).

    python examples/decode_loop.py --requests 4 &
    python examples/prefill_loop.py --connect tcp://127.0.0.1:5555 --requests 4

Runs on a CPU: the 'GPU' cache is ordinary host tensors there.
"""

import argparse

import pdkv

ap = argparse.ArgumentParser()
ap.add_argument("--listen", default="tcp://127.0.0.1:5555")
ap.add_argument("--requests", type=int, default=4)
ap.add_argument("--framework", choices=["torch", "paddle"], default="torch")
a = ap.parse_args()

layout = pdkv.KVLayout(num_layers=4, kv_heads=4, head_dim=64, tokens_per_block=16, dtype="float16")
GPU_BLOCKS, BUFFER_BLOCKS = 16, 64
if a.framework == "torch":
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kv = [
        [torch.zeros((GPU_BLOCKS, 4, 16, 64), dtype=torch.float16, device=device) for _ in range(2)]
        for _ in range(layout.total_layers)
    ]
else:
    import paddle

    kv = [
        [paddle.zeros([GPU_BLOCKS, 4, 16, 64], dtype="float16") for _ in range(2)] for _ in range(layout.total_layers)
    ]

gpu = pdkv.cache_from_tensors(layout, kv)  # checked: shape, dtype, contiguity, device
buf = pdkv.SharedBuffer.create(pdkv.CacheSpec.buffer_bytes(layout, BUFFER_BLOCKS))
swap = pdkv.SwapEngine(pdkv.CacheSpec.for_buffer(layout, BUFFER_BLOCKS, buf.address), gpu, buffer_pinned=buf.pinned)
sched = pdkv.DecodeScheduler(
    layout=layout,
    gpu=pdkv.BlockPool(GPU_BLOCKS),
    buffer=pdkv.BlockPool(BUFFER_BLOCKS),
    swap=swap,
    options=pdkv.SchedulerOptions(direct_to_gpu=False, lease_s=30),
)
rx = pdkv.DecodeReceiver(sched, [layout], [buf], BUFFER_BLOCKS, control=a.listen)
print("decode ready on", rx.control_address, flush=True)

done = 0
try:
    while done < a.requests:
        sched.tick()  # the engine loop drives the scheduler
        for r in sched.take_ready():
            first = kv[0][0][r.gpu_blocks[0]].flatten()[0]  # the request's KV is in these blocks now
            print(
                f"{r.request_id}: ready in GPU blocks {list(r.gpu_blocks)}, K[0] starts with {float(first):.3f}",
                flush=True,
            )
            sched.finish(r.request_id)  # decoding finished: blocks go back
            done += 1
finally:
    rx.close()
    swap.close()
    buf.close()
    buf.unlink()
