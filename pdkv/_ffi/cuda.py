"""One funnel over ``cuda.bindings``: runtime, plus driver and NVRTC loaded lazily.

Every call goes through :func:`_call`, which turns a non-success status into
:class:`~pdkv.errors.CudaError` carrying the status name and description. Statuses that
mean "absent" are values, not exceptions: :func:`device_count` is 0 without bindings,
driver or device; :func:`event_query` is ``False`` while work is pending.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import CudaError, CudaUnavailableError

__all__ = [
    "bindings_available",
    "compile_kernel",
    "device_count",
    "compute_capability",
    "enable_peer_access",
    "current_device",
    "set_device",
    "on_device",
    "host_register",
    "host_unregister",
    "host_device_pointer",
    "pointer_info",
    "malloc",
    "free",
    "malloc_host",
    "multiprocessor_count",
    "free_host",
    "memcpy",
    "memset",
    "memcpy_async",
    "memcpy_batch_async",
    "stream_create",
    "stream_destroy",
    "stream_synchronize",
    "event_create",
    "event_record",
    "event_query",
    "event_synchronize",
    "event_elapsed_ms",
    "event_destroy",
    "launch",
    "mem_get_info",
    "dmabuf_supported",
    "pci_bus_id",
    "set_sync_memops",
    "dmabuf_fd",
]

_lock = threading.Lock()
_mods: dict[str, Any] = {}

# cudaError_t values that mean "there is no usable CUDA here"
_ABSENT_STATUSES = {35, 100}  # cudaErrorInsufficientDriver, cudaErrorNoDevice


def _rt() -> Any:
    mod = _mods.get("rt")
    if mod is None:
        try:
            from cuda.bindings import runtime as _imported_rt
        except ImportError as exc:
            raise CudaUnavailableError("CUDA support needs cuda-bindings: pip install 'pdkv[cuda]'") from exc
        mod = _mods["rt"] = _imported_rt
    return mod


def _drv() -> Any:
    mod = _mods.get("drv")
    if mod is None:
        _rt()
        try:
            from cuda.bindings import driver as _imported_drv

            _check_drv(_imported_drv.cuInit(0), "cuInit")
        except RuntimeError as exc:  # cuda.pathfinder: library not found
            raise CudaUnavailableError(f"CUDA driver library not found: {exc}") from exc
        mod = _mods["drv"] = _imported_drv
    return mod


def _nvrtc() -> Any:
    mod = _mods.get("nvrtc")
    if mod is None:
        _rt()
        try:
            from cuda.bindings import nvrtc as _imported_nvrtc

            _imported_nvrtc.nvrtcVersion()
        except RuntimeError as exc:
            raise CudaUnavailableError(f"NVRTC not found (pip install 'pdkv[cuda]' brings it): {exc}") from exc
        mod = _mods["nvrtc"] = _imported_nvrtc
    return mod


def bindings_available() -> bool:
    """True when ``cuda.bindings`` imports (says nothing about a driver or device)."""
    try:
        _rt()
    except CudaUnavailableError:
        return False
    return True


def _raise(code: int, call: str) -> None:
    rt = _rt()
    try:
        err = rt.cudaError_t(code)
        name = rt.cudaGetErrorName(err)[1].decode()
        desc = rt.cudaGetErrorString(err)[1].decode()
    except Exception:  # an unknown code, or a driver-API status below
        name, desc = f"status {code}", "unknown CUDA status"
    raise CudaError(code, name, desc, call)


def _call(res: Any, call: str) -> Any:
    """Check a runtime-API ``(status, *values)`` tuple; return the values."""
    status, *rest = res if isinstance(res, tuple) else (res,)
    code = int(status)
    if code != 0:
        _raise(code, call)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def _check_drv(res: Any, call: str) -> Any:
    status, *rest = res if isinstance(res, tuple) else (res,)
    code = int(status)
    if code != 0:
        drv = _mods.get("drv")
        name = desc = ""
        if drv is not None:
            try:
                name = drv.cuGetErrorName(status)[1].decode()
                desc = drv.cuGetErrorString(status)[1].decode()
            except Exception:
                pass
        raise CudaError(code, name or f"CUresult {code}", desc or "driver API error", call)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def _check_nvrtc(res: Any, call: str, prog: Any = None) -> Any:
    status, *rest = res if isinstance(res, tuple) else (res,)
    code = int(status)
    if code != 0:
        nv = _nvrtc()
        log = ""
        if prog is not None:
            try:
                size = nv.nvrtcGetProgramLogSize(prog)[1]
                buf = b" " * size
                nv.nvrtcGetProgramLog(prog, buf)
                log = buf.decode(errors="replace")
            except Exception:
                pass
        name = nv.nvrtcGetErrorString(status)[1].decode()
        raise CudaError(code, name, f"NVRTC failed{': ' + log if log else ''}", call)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


# ---------------------------------------------------------------- devices


def device_count() -> int:
    """Number of CUDA devices; 0 without bindings, driver or device. Raises on other errors."""
    try:
        rt = _rt()
    except CudaUnavailableError:
        return 0
    status, n = rt.cudaGetDeviceCount()
    if int(status) in _ABSENT_STATUSES:
        return 0
    _call((status,), "cudaGetDeviceCount")
    return int(n)


def set_device(device: int) -> None:
    _call(_rt().cudaSetDevice(device), "cudaSetDevice")


def current_device() -> int:
    return int(_call(_rt().cudaGetDevice(), "cudaGetDevice"))


@contextlib.contextmanager
def on_device(device: int) -> Iterator[None]:
    """Make ``device`` current in this thread for the block, and the caller's device again
    after it. CUDA's current device is per thread and decides where events, streams,
    kernels and IPC mappings are made; a library call must neither depend on the caller's
    choice nor change it."""
    prev = current_device()
    if prev != device:
        set_device(device)
    try:
        yield
    finally:
        if prev != device:
            set_device(prev)


def compute_capability(device: int) -> tuple[int, int]:
    rt = _rt()
    a = rt.cudaDeviceAttr
    major = _call(rt.cudaDeviceGetAttribute(a.cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute")
    minor = _call(rt.cudaDeviceGetAttribute(a.cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute")
    return int(major), int(minor)


def mem_get_info() -> tuple[int, int]:
    free_b, total = _call(_rt().cudaMemGetInfo(), "cudaMemGetInfo")
    return int(free_b), int(total)


# ---------------------------------------------------------------- host memory


def host_register(addr: int, size: int, *, mapped: bool = True, portable: bool = True) -> None:
    """Page-lock ``[addr, addr+size)`` with ``cudaHostRegister``."""
    rt = _rt()
    flags = 0
    if portable:
        flags |= rt.cudaHostRegisterPortable
    if mapped:
        flags |= rt.cudaHostRegisterMapped
    _call(rt.cudaHostRegister(addr, size, flags), "cudaHostRegister")


def host_unregister(addr: int) -> None:
    _call(_rt().cudaHostUnregister(addr), "cudaHostUnregister")


def host_device_pointer(addr: int) -> int:
    """Device address of a mapped, registered host pointer (equal to it under UVA)."""
    return int(_call(_rt().cudaHostGetDevicePointer(addr, 0), "cudaHostGetDevicePointer"))


def pointer_info(ptr: int) -> tuple[str, int]:
    """``(kind, device)`` of a pointer: kind is 'device', 'host', 'managed' or 'unregistered'."""
    rt = _rt()
    attrs = _call(rt.cudaPointerGetAttributes(ptr), "cudaPointerGetAttributes")
    t = int(attrs.type)
    kind = {0: "unregistered", 1: "host", 2: "device", 3: "managed"}.get(t, f"type{t}")
    return kind, int(attrs.device)


def malloc(size: int) -> int:
    return int(_call(_rt().cudaMalloc(size), "cudaMalloc"))


def free(ptr: int) -> None:
    _call(_rt().cudaFree(ptr), "cudaFree")


def malloc_host(size: int) -> int:
    return int(_call(_rt().cudaMallocHost(size), "cudaMallocHost"))


def free_host(ptr: int) -> None:
    _call(_rt().cudaFreeHost(ptr), "cudaFreeHost")


# ---------------------------------------------------------------- CUDA IPC

IPC_HANDLE_BYTES = 64


def address_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the device allocation holding ``ptr`` (``cuMemGetAddressRange``):
    an IPC handle names a whole allocation, and caching allocators hand out parts of one."""
    drv = _drv()
    base, size = _check_drv(drv.cuMemGetAddressRange(drv.CUdeviceptr(ptr)), "cuMemGetAddressRange")
    return int(base), int(size)


def pci_bus_id(device: int) -> str:
    """The device's PCI address, ``dddd:bb:dd.f`` (as sysfs names it, lower case)."""
    raw = _call(_rt().cudaDeviceGetPCIBusId(32, device), "cudaDeviceGetPCIBusId")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.split("\x00", 1)[0].strip().lower()


def dmabuf_supported(device: int) -> bool:
    """Whether ``device`` can export its memory as a dma-buf (``CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED``:
    the open kernel modules on Turing or later)."""
    drv = _drv()
    _check_drv(drv.cuInit(0), "cuInit")
    attr = getattr(drv.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED", None)
    if attr is None:  # bindings older than the attribute
        return False
    dev = _check_drv(drv.cuDeviceGet(device), "cuDeviceGet")
    return bool(_check_drv(drv.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute"))


def set_sync_memops(ptr: int) -> None:
    """``CU_POINTER_ATTRIBUTE_SYNC_MEMOPS`` on the allocation holding ``ptr``: memory
    operations on it complete before CUDA returns, as a NIC reading it directly needs."""
    import ctypes as _ct

    drv = _drv()
    one = _ct.c_uint(1)
    _check_drv(
        drv.cuPointerSetAttribute(
            _ct.addressof(one), drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, drv.CUdeviceptr(ptr)
        ),
        "cuPointerSetAttribute",
    )


def dmabuf_fd(base: int, size: int) -> int:
    """A dma-buf file descriptor for device memory ``[base, base+size)`` (page-aligned; a
    whole allocation: :func:`address_range`), for an RDMA NIC to register
    (``cuMemGetHandleForAddressRange``). The caller closes it once registered."""
    drv = _drv()
    kind = drv.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    fd = _check_drv(
        drv.cuMemGetHandleForAddressRange(drv.CUdeviceptr(base), size, kind, 0), "cuMemGetHandleForAddressRange"
    )
    return int(fd)


def ipc_get_handle(base: int) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` of the allocation starting at ``base``."""
    h = _call(_rt().cudaIpcGetMemHandle(base), "cudaIpcGetMemHandle")
    return ctypes.string_at(h.getPtr(), IPC_HANDLE_BYTES)


def ipc_open(handle: bytes) -> int:
    """Map another process's allocation into this one (peer access enabled lazily when it
    lives on another device); returns its base here. Close with :func:`ipc_close`."""
    if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes")
    rt = _rt()
    h = rt.cudaIpcMemHandle_t()
    ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_BYTES)
    return int(_call(rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"))


def ipc_close(ptr: int) -> None:
    _call(_rt().cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")


def device_uuid(device: int) -> str:
    """The device's UUID as hex (the same GPU has the same UUID in every process)."""
    drv = _drv()
    _check_drv(drv.cuInit(0), "cuInit")
    dev = _check_drv(drv.cuDeviceGet(device), "cuDeviceGet")
    u = _check_drv(drv.cuDeviceGetUuid(dev), "cuDeviceGetUuid")
    raw = u.bytes if hasattr(u, "bytes") else ctypes.string_at(u.getPtr(), 16)
    return bytes(raw).hex()


def device_uuids() -> list[str]:
    """The UUID (hex) of every device this process sees, by ordinal; [] without CUDA."""
    return [device_uuid(d) for d in range(device_count())]


def can_access_peer(device: int, peer: int) -> bool:
    rt = _rt()
    return bool(_call(rt.cudaDeviceCanAccessPeer(device, peer), "cudaDeviceCanAccessPeer"))


def enable_peer_access(peer: int) -> None:
    """Let kernels on the current device address ``peer``'s memory (already enabled: fine)."""
    rt = _rt()
    (status,) = rt.cudaDeviceEnablePeerAccess(peer, 0)
    if int(status) == int(rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled):
        rt.cudaGetLastError()  # the runtime also keeps it as the sticky last error
        return
    _call((status,), "cudaDeviceEnablePeerAccess")


def multiprocessor_count(device: int) -> int:
    rt = _rt()
    return int(
        _call(
            rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrMultiProcessorCount, device),
            "cudaDeviceGetAttribute",
        )
    )


def memcpy(dst: int, src: int, size: int) -> None:
    rt = _rt()
    _call(rt.cudaMemcpy(dst, src, size, rt.cudaMemcpyKind.cudaMemcpyDefault), "cudaMemcpy")


def memset(ptr: int, value: int, size: int) -> None:
    _call(_rt().cudaMemset(ptr, value, size), "cudaMemset")


# ---------------------------------------------------------------- streams and events


def stream_create(nonblocking: bool = True) -> int:
    rt = _rt()
    flags = rt.cudaStreamNonBlocking if nonblocking else rt.cudaStreamDefault
    return int(_call(rt.cudaStreamCreateWithFlags(flags), "cudaStreamCreateWithFlags"))


def stream_destroy(stream: int) -> None:
    _call(_rt().cudaStreamDestroy(stream), "cudaStreamDestroy")


def stream_synchronize(stream: int) -> None:
    _call(_rt().cudaStreamSynchronize(stream), "cudaStreamSynchronize")


def event_create(timing: bool = False) -> int:
    rt = _rt()
    flags = rt.cudaEventDefault if timing else rt.cudaEventDisableTiming
    return int(_call(rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags"))


def event_record(event: int, stream: int) -> None:
    _call(_rt().cudaEventRecord(event, stream), "cudaEventRecord")


def event_query(event: int) -> bool:
    """True when the event completed, False while pending; other statuses raise."""
    (status,) = _rt().cudaEventQuery(event)
    if int(status) == 600:  # cudaErrorNotReady
        return False
    _call((status,), "cudaEventQuery")
    return True


def stream_wait_event(stream: int, event: int) -> None:
    """Work submitted to ``stream`` after this waits for ``event``."""
    _call(_rt().cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent")


def event_synchronize(event: int) -> None:
    _call(_rt().cudaEventSynchronize(event), "cudaEventSynchronize")


def event_elapsed_ms(start: int, end: int) -> float:
    return float(_call(_rt().cudaEventElapsedTime(start, end), "cudaEventElapsedTime"))


def event_destroy(event: int) -> None:
    _call(_rt().cudaEventDestroy(event), "cudaEventDestroy")


# ---------------------------------------------------------------- copies


def memcpy_async(dst: int, src: int, size: int, stream: int) -> None:
    rt = _rt()
    _call(
        rt.cudaMemcpyAsync(dst, src, size, rt.cudaMemcpyKind.cudaMemcpyDefault, stream),
        "cudaMemcpyAsync",
    )


def batch_copy_supported() -> bool:
    return hasattr(_rt(), "cudaMemcpyBatchAsync")


def _as_list(x: Sequence[int]) -> list[int]:
    return x if isinstance(x, list) else list(x)


def memcpy_batch_async(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: int) -> None:
    """One ``cudaMemcpyBatchAsync`` call (CUDA 12.8+).

    Returns ``(err, failIdx)`` on 12.x bindings and ``(err,)`` on 13.x; both are handled.
    """
    rt = _rt()
    if not hasattr(rt, "cudaMemcpyBatchAsync"):
        raise CudaUnavailableError("cudaMemcpyBatchAsync needs CUDA 12.8+ bindings")
    n = len(sizes)
    if n == 0:
        return
    attr = rt.cudaMemcpyAttributes()
    attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    attr.flags = getattr(rt, "cudaMemcpyFlagPreferOverlapWithCompute", 0)
    res = rt.cudaMemcpyBatchAsync(_as_list(dsts), _as_list(srcs), _as_list(sizes), n, [attr], [0], 1, stream)
    status = res[0] if isinstance(res, tuple) else res
    if int(status) != 0:
        fail = f" (failed at copy {res[1]})" if isinstance(res, tuple) and len(res) > 1 else ""
        _raise(int(status), "cudaMemcpyBatchAsync" + fail)


# ---------------------------------------------------------------- NVRTC kernels

_cubins: dict[tuple[str, str, tuple[int, int]], bytes] = {}
_kernels: dict[tuple[str, str, int], Any] = {}


def compile_kernel(source: str, name: str, device: int | None = None) -> Any:
    """Compile ``source`` with NVRTC for ``device``'s architecture and return the function
    loaded on ``device`` (the current one if None).

    A kernel compiles once per process and architecture, and is loaded once per device: a
    loaded function belongs to its device's context and cannot be launched on another.
    """
    dev = current_device() if device is None else device
    arch = compute_capability(dev)
    with _lock:
        fn = _kernels.get((source, name, dev))
        if fn is not None:
            return fn
        cubin = _cubins.get((source, name, arch))
        if cubin is None:
            nv = _nvrtc()
            prog = _check_nvrtc(
                nv.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "nvrtcCreateProgram"
            )
            try:
                opts = [f"--gpu-architecture=sm_{arch[0]}{arch[1]}".encode(), b"-std=c++17", b"--use_fast_math"]
                _check_nvrtc(nv.nvrtcCompileProgram(prog, len(opts), opts), "nvrtcCompileProgram", prog)
                size = _check_nvrtc(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
                cubin = b" " * size
                _check_nvrtc(nv.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            finally:
                nv.nvrtcDestroyProgram(prog)
            _cubins[(source, name, arch)] = cubin
        drv = _drv()
        with on_device(dev):
            _call(_rt().cudaFree(0), "cudaFree(0)")  # make the device's primary context current
            module = _check_drv(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
            fn = _check_drv(drv.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")
        _kernels[(source, name, dev)] = fn
        return fn


_CTYPES = {
    "ptr": ctypes.c_void_p,
    "u64": ctypes.c_uint64,
    "i64": ctypes.c_int64,
    "u32": ctypes.c_uint32,
    "i32": ctypes.c_int32,
}


def launch(fn: Any, grid: int, block: int, args: Sequence[tuple[str, int]], stream: int, shared_mem: int = 0) -> None:
    """Launch a compiled kernel; ``args`` is a list of (type, value), type in ptr/u64/i64/u32/i32."""
    drv = _drv()
    vals = [_CTYPES[t](v) for t, v in args]
    ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    _check_drv(
        drv.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, shared_mem, stream, ctypes.addressof(ptrs), 0),
        "cuLaunchKernel",
    )
