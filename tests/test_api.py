"""The public surface: what `import pdkv` offers, and that it needs neither CUDA nor pyverbs."""

from __future__ import annotations

import subprocess
import sys

import pdkv

PUBLIC = {
    "__version__",
    "GIB",
    "BlockAllocator",
    "BlockPool",
    "CacheSpec",
    "CopyHandle",
    "CopyPlan",
    "DecodeReceiver",
    "DecodeScheduler",
    "Event",
    "Grant",
    "KVLayout",
    "PrefillSender",
    "ReadyRequest",
    "RequestInfo",
    "RequestOutcome",
    "Reservation",
    "SchedulerOptions",
    "Segment",
    "SendGrant",
    "SharedBuffer",
    "State",
    "SwapBackend",
    "SwapEngine",
    "SwapGroup",
    "SwapHandle",
    "TensorInfo",
    "aligned_empty",
    "cache_from_tensors",
    "plan_copy",
    "tensor_info",
    "tp_segments",
    "WriteTicket",
    "EventKind",
    "ReceiverOptions",
    "SenderOptions",
    *pdkv.errors.__all__,
}


def test_public_surface():
    assert set(pdkv.__all__) == PUBLIC
    for name in pdkv.__all__:
        assert getattr(pdkv, name) is not None
        obj = getattr(pdkv, name)
        if callable(obj) and not name.startswith("_"):
            assert obj.__doc__, f"{name} has no docstring"


def test_import_without_cuda_or_pyverbs():
    code = (
        "import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None; sys.modules['pyverbs'] = None\n"
        "import pdkv\n"
        "from pdkv import _ffi\n"
        "assert _ffi.cuda.device_count() == 0\n"
        "assert _ffi.verbs.rdma_devices() == []\n"
        "try:\n    pdkv.SharedBuffer.create(4096, require_pinned=True)\n"
        "except pdkv.CudaUnavailableError as e:\n    print('OK', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK") and "no CUDA device" in out.stdout


def test_only_ffi_touches_c():
    import pathlib
    import re

    root = pathlib.Path(pdkv.__file__).parent
    for f in root.rglob("*.py"):
        if "_ffi" in f.parts:
            continue
        text = f.read_text()
        # the module names as imports use them (``_ffi.cuda.bindings_available`` is not one)
        for mod in (r"import ctypes\b", r"from ctypes\b", r"cuda\.bindings\b", r"import pyverbs\b", r"from pyverbs\b"):
            assert not re.search(mod, text), f"{f.name} uses {mod}: only pdkv/_ffi may"
