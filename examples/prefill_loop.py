#!/usr/bin/env python3
"""A minimal prefill loop: the KV cache is torch (or paddle) tensors; after each layer is
'computed' it is handed to pdkv, which writes it into decode's buffer while the next
layer computes. Blocks are freed only once decode reports the outcome."""

import argparse

import pdkv

ap = argparse.ArgumentParser()
ap.add_argument("--connect", default="tcp://127.0.0.1:5555")
ap.add_argument("--requests", type=int, default=4)
ap.add_argument("--framework", choices=["torch", "paddle"], default="torch")
a = ap.parse_args()

layout = pdkv.KVLayout(num_layers=4, kv_heads=4, head_dim=64, tokens_per_block=16, dtype="float16")
BLOCKS = 32
if a.framework == "torch":
    import torch

    kv = [[torch.zeros((BLOCKS, 4, 16, 64), dtype=torch.float16) for _ in range(2)] for _ in range(layout.total_layers)]
    fill = lambda t, blocks, value: t[blocks].fill_(value)  # noqa: E731
else:
    import paddle

    kv = [[paddle.zeros([BLOCKS, 4, 16, 64], dtype="float16") for _ in range(2)] for _ in range(layout.total_layers)]
    fill = lambda t, blocks, value: t.__setitem__(blocks, value)  # noqa: E731

cache = pdkv.cache_from_tensors(layout, kv)
pool = pdkv.BlockPool(BLOCKS)
with pdkv.PrefillSender(layout, cache, a.connect, instance="example-prefill") as tx:
    for i in range(a.requests):
        rid = f"req-{i}"
        blocks = pool.allocate(3)                          # this engine's own blocks for the prompt
        tx.reserve(rid, num_tokens=40)                     # decode's blocks: no wait for decode GPU room
        for layer in range(layout.total_layers):
            for t in kv[layer]:                            # 'compute' layer L
                for b in blocks:
                    fill(t, b, float(i + 1))
            tx.send_layer(layer, [(rid, blocks)])          # sent while the next layer computes
        tx.finish(rid)
        outcome = tx.wait_outcome(rid, timeout=30)
        print(rid, outcome.state, flush=True)
        pool.free(blocks)                                  # only after a definite outcome
