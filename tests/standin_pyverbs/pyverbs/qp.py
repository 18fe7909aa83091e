from .addr import AHAttr
from .cq import CQ
from .pd import PD
from .wr import SendWR


class QPCap:
    def __init__(self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1, max_inline_data=0):
        pass


class QPInitAttr:
    def __init__(self, qp_type=2, qp_context=None, scq=None, rcq=None, srq=None, cap=None, sq_sig_all=1):
        if not isinstance(qp_type, int) or not isinstance(scq, CQ) or not isinstance(rcq, CQ):
            raise TypeError("QPInitAttr(qp_type: int, scq: CQ, rcq: CQ, ...)")


class QPAttr:
    def __init__(
        self,
        qp_state=0,
        cur_qp_state=0,
        port_num=1,
        path_mtu=5,
        qkey=0,
        rq_psn=0,
        sq_psn=0,
        dest_qp_num=0,
        qp_access_flags=0,
    ):
        self.ah_attr = None
        self.qp_state = qp_state


class QP:
    qp_num = 0x123

    def __init__(self, creator, init_attr, qp_attr=None):
        if not isinstance(creator, PD) or not isinstance(init_attr, QPInitAttr):
            raise TypeError("QP(pd, QPInitAttr)")

    def to_init(self, attr):
        if not isinstance(attr.qp_access_flags, int):
            raise TypeError("qp_access_flags must be an int")

    def to_rtr(self, attr):
        if not isinstance(attr.ah_attr, AHAttr):
            raise TypeError("ah_attr must be an AHAttr")
        self.rq_psn = attr.rq_psn
        self.hop_limit = attr.ah_attr.gr.hop_limit if attr.ah_attr.gr is not None else None

    def to_rts(self, attr):
        self.sq_psn = attr.sq_psn  # the stand-in records it for the test

    def modify(self, qp_attr, qp_attr_mask):
        if not isinstance(qp_attr, QPAttr) or not isinstance(qp_attr_mask, int):
            raise TypeError("QP.modify(QPAttr qp_attr, int qp_attr_mask)")
        self.state = qp_attr.qp_state

    def post_send(self, send_wr, bad_wr=None):
        if not isinstance(send_wr, SendWR):
            raise TypeError("post_send takes a SendWR")

    def close(self):
        pass
