"""``Mlx5DmaBufMR`` with the signature of rdma-core's pyverbs/providers/mlx5/mlx5dv_dmabuf.pyx
(``mlx5dv_reg_dmabuf_mr``: pd, offset, length, iova, fd, access, mlx5_access)."""

from ...pd import PD
from ...pyverbs_error import PyverbsRDMAError

CALLS = []


class Mlx5DmaBufMR:
    def __init__(self, pd, offset, length, iova=0, fd=None, access=0, mlx5_access=0):
        if not isinstance(pd, PD) or not all(isinstance(x, int) for x in (offset, length, iova, access)):
            raise TypeError("Mlx5DmaBufMR(PD pd, offset, length, iova=0, fd=None, access=0, mlx5_access=0)")
        if not isinstance(fd, int) or fd < 0:
            raise PyverbsRDMAError("Failed to register a mlx5 dma-buf MR: bad fd")
        CALLS.append((offset, length, iova, fd, access))
        self.lkey, self.rkey = 0x33, 0x44

    def close(self):
        pass
