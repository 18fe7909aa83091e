import time, statistics, sys, numpy as np, torch, pdkv
from pdkv import _ffi
N=4096; reps=64
torch.cuda.set_device(0)
for kib in (16, 32):
    size=kib<<10; T=size//1024
    lay = pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=T, dtype="bf16", mla=True)
    nb=2*N
    buf = pdkv.SharedBuffer.create(nb*size, require_pinned=True)
    gpu = torch.empty(nb*size, dtype=torch.uint8, device="cuda")
    b=pdkv.CacheSpec.for_buffer(lay, nb, buf.address); g=pdkv.CacheSpec.for_buffer(lay, nb, gpu.data_ptr())
    rng=np.random.default_rng(0); src=rng.permutation(nb)[:N].tolist(); dst=rng.permutation(nb)[:N].tolist()
    eng = pdkv.SwapEngine(b, g, strategy="auto")
    for direction in ("h2d","d2h"):
        e0=_ffi.cuda.event_create(timing=True); e1=_ffi.cuda.event_create(timing=True)
        s_, d_ = (src, dst) if direction == "h2d" else (dst, src)
        def burst():
            t0=time.perf_counter()
            _ffi.cuda.event_record(e0, eng._stream)
            ts=time.perf_counter()
            hs=[eng.copy(s_, d_, direction=direction) for _ in range(reps)]
            tsub=time.perf_counter()-ts
            _ffi.cuda.event_record(e1, eng._stream)
            for h in hs: h.wait(60)
            t1=time.perf_counter()
            _ffi.cuda.event_synchronize(e1)
            return (t1-t0), _ffi.cuda.event_elapsed_ms(e0,e1)/1e3, tsub
        burst()
        rs=[burst() for _ in range(5)]
        tot=N*size*reps
        for w,gt,sub in rs:
            print(f"{kib} {direction} wall {tot/w/1e9:.1f} GB/s  gpu-span {tot/gt/1e9:.1f} GB/s  submit {sub*1e3:.1f} ms of {w*1e3:.1f}")
    eng.close(); del gpu; buf.close(); buf.unlink()
