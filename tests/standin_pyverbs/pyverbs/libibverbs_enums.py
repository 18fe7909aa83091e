"""Cython >= 3.1 makes each ``cpdef enum`` a Python enum type: members are attributes of
their type, not of this module."""

import enum


class ibv_access_flags(enum.IntFlag):
    IBV_ACCESS_LOCAL_WRITE = 1
    IBV_ACCESS_REMOTE_WRITE = 1 << 1
    IBV_ACCESS_REMOTE_READ = 1 << 2


class ibv_qp_type(enum.IntEnum):
    IBV_QPT_RC = 2
    IBV_QPT_UC = 3
    IBV_QPT_UD = 4


class ibv_wr_opcode(enum.IntEnum):
    IBV_WR_RDMA_WRITE = 0
    IBV_WR_RDMA_WRITE_WITH_IMM = 1
    IBV_WR_SEND = 2


class ibv_send_flags(enum.IntFlag):
    IBV_SEND_FENCE = 1 << 0
    IBV_SEND_SIGNALED = 1 << 1


class ibv_wc_status(enum.IntEnum):
    IBV_WC_SUCCESS = 0
    IBV_WC_WR_FLUSH_ERR = 5
    IBV_WC_RETRY_EXC_ERR = 12


class ibv_qp_state(enum.IntEnum):
    IBV_QPS_RESET = 0
    IBV_QPS_INIT = 1
    IBV_QPS_RTR = 2
    IBV_QPS_RTS = 3
    IBV_QPS_SQD = 4
    IBV_QPS_SQE = 5
    IBV_QPS_ERR = 6


class ibv_qp_attr_mask(enum.IntFlag):
    IBV_QP_STATE = 1 << 0
    IBV_QP_CUR_STATE = 1 << 1
