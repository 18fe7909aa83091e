from .pd import PD
from .pyverbs_error import PyverbsRDMAError


class MR:
    def __init__(self, creator, length, access, address=None, implicit=False, iova=0):
        if not isinstance(creator, PD) or not isinstance(length, int) or not isinstance(access, int):
            raise TypeError("MR(pd, length: int, access: int, address=...)")
        if address == 0xBAD000:  # what the kernel does with GPU memory and no peer-memory client
            raise PyverbsRDMAError(f"Failed to register a MR. length: {length}", 14)
        self.lkey, self.rkey = 0x11, 0x22

    def close(self):
        pass
