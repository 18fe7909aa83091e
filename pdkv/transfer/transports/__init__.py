"""The transports: how bytes move from a prefill rank into the blocks decode granted.

``base`` (the interface every transport implements, and the registry the sessions reach
transports through), one module per transport (``shm``, ``tcp``, ``rdma`` with ``rdma_qp``,
``cuda_ipc`` with ``ipc_export``, ``nixl``) and what several of them share: ``sockets``
(authenticated data connections), ``staging`` (staged copies through pinned host memory)
and ``hostcopy`` (host copies by threads).

May import: everything below ``pdkv.transfer`` (errors, layout, protocol, plan, scheduling,
buffer, swap, ``integrations.interop``, ``_ffi``); never the sessions.
"""
