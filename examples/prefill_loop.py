#!/usr/bin/env python3
"""A minimal prefill loop: the KV cache is torch (or paddle) tensors; prompts are prefilled
in batches; after each layer of a batch is 'computed' it is handed to pdkv, which writes it
into decode's buffer while the next layer computes. Blocks are freed only once decode
reports the outcome."""

import argparse

import pdkv

ap = argparse.ArgumentParser()
ap.add_argument("--connect", default="tcp://127.0.0.1:5555")
ap.add_argument("--requests", type=int, default=4)
ap.add_argument("--batch", type=int, default=2, help="prompts prefilled together")
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
    ids = [f"req-{i}" for i in range(a.requests)]
    for start in range(0, len(ids), a.batch):  # a batch of prompts prefilled together
        batch = ids[start : start + a.batch]
        blocks = {rid: pool.allocate(3) for rid in batch}  # this engine's own blocks for each prompt
        grants = tx.reserve_many([(rid, 40) for rid in batch])  # decode's blocks, round trips overlapped
        failed = [rid for rid, g in zip(batch, grants) if isinstance(g, Exception)]
        batch = [rid for rid in batch if rid not in failed]
        for layer in range(layout.total_layers):
            for rid in batch:  # 'compute' layer L of every prompt
                for t in kv[layer]:
                    for b in blocks[rid]:
                        fill(t, b, float(ids.index(rid) + 1))
            tx.send_layer(layer, [(rid, blocks[rid]) for rid in batch])  # sent while the next layer computes
        tx.finish_many(batch)
        for rid in ids[start : start + a.batch]:
            state = "rejected" if rid in failed else tx.wait_outcome(rid, timeout=30).state
            print(rid, state, flush=True)
            pool.free(blocks[rid])  # only after a definite outcome
