from .pd import PD


class MR:
    def __init__(self, creator, length, access, address=None, implicit=False, iova=0):
        if not isinstance(creator, PD) or not isinstance(length, int) or not isinstance(access, int):
            raise TypeError("MR(pd, length: int, access: int, address=...)")
        self.lkey, self.rkey = 0x11, 0x22

    def close(self):
        pass
