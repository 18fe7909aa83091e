class SGE:
    def __init__(self, addr, length, lkey):
        if not all(isinstance(x, int) for x in (addr, length, lkey)):
            raise TypeError("SGE(addr, length, lkey) take ints")


class SendWR:
    def __init__(self, wr_id=0, opcode=0, num_sge=0, imm_data=0, sg=None, send_flags=0):
        if not isinstance(opcode, int) or not isinstance(send_flags, int):
            raise TypeError("opcode and send_flags are ints")
        self.next_wr = None

    def set_wr_rdma(self, rkey, addr):
        if not isinstance(rkey, int) or not isinstance(addr, int):
            raise TypeError("set_wr_rdma(rkey: int, addr: int)")
