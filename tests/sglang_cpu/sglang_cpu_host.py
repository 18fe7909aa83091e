"""A test-only SGLang general plugin for a CPU host, so that decode's HiCache host pool
(``--enable-hierarchical-cache``, the pool pdkv's decode host receive writes) runs where
SGLang never built it to run:

- SGLang pins the host pool with ``cudaHostRegister`` whatever the device
  (``mem_cache/pool_host/common.py``; no flag turns it off): with no GPU there is nothing
  to pin for, so registering and unregistering are no-ops.
- The pool's host <-> device copies are CUDA kernels of ``sgl_kernel.kvcacheio``, imported
  only on CUDA, ROCm and XPU: here they are the same copies in torch (token rows of every
  layer's K and V, by index; the ``layer_first`` layout, SGLang's default).

- SGLang's Mooncake prefill copies page indices through pinned memory and a CUDA event when
  its sender says ``supports_host_tensor_indices``: with ``SGLANG_CPU_MOONCAKE=1`` (set by
  the tests for Mooncake servers only) it says no, and SGLang takes its plain path.

On a GPU host SGLang's own code runs and none of this is loaded. Found by SGLang's
``load_plugins()`` through the distribution record beside this file
(``sglang_cpu_host-0.dist-info``) when this folder is on ``PYTHONPATH``."""


def _not_pinned(*_args, **_kwargs):
    return None


def _pairs(pool, layer):
    return ((pool.k_buffer[layer], pool.device_k_buffers[layer]), (pool.v_buffer[layer], pool.device_v_buffers[layer]))


def _check(pool):
    if pool.layout != "layer_first":
        raise NotImplementedError(f"the CPU stand-in copies the layer_first host layout only, not {pool.layout!r}")


def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False):
    if not is_draft and not 0 <= layer_id < self.target_layer_num:
        return
    _check(self)
    for host, dev in _pairs(self, layer_id):
        dev[device_indices] = host[host_indices].to(dev.dtype)


def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
    _check(self)
    for layer in range(self.layer_num):
        for host, dev in _pairs(self, layer):
            host[host_indices] = dev[device_indices].to(host.dtype)


def plugin():
    import os

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if os.environ.get("SGLANG_CPU_MOONCAKE") == "1":
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

        MooncakeKVSender.supports_host_tensor_indices = False

    for name in ("_cuda_host_register", "_cuda_host_unregister"):
        HookRegistry.register(f"sglang.srt.mem_cache.pool_host.common.{name}", _not_pinned, HookType.REPLACE)
    cls = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"
    HookRegistry.register(f"{cls}.load_to_device_per_layer", load_to_device_per_layer, HookType.REPLACE)
    HookRegistry.register(f"{cls}.backup_from_device_all_layer", backup_from_device_all_layer, HookType.REPLACE)
