"""A stand-in for rdma-core's pyverbs (v59, built with Cython >= 3.1) with the class
signatures and argument types pdkv calls, and no device behind them: enough to show that
pdkv's verbs calls would be accepted by the real classes. Written from rdma-core's pyverbs
sources (addr.pyx, qp.pyx, mr.pyx, wr.pyx, libibverbs_enums.pxd); there is no
``pyverbs.enums`` (removed in v59)."""
