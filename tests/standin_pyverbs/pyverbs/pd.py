from .device import Context


class PD:
    def __init__(self, creator):
        if not isinstance(creator, Context):
            raise TypeError("PD needs a Context")

    def close(self):
        pass
