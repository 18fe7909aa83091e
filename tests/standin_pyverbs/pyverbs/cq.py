from .device import Context


class CQ:
    def __init__(self, context, cqe, cq_context=None, channel=None, comp_vector=0):
        if not isinstance(context, Context) or not isinstance(cqe, int):
            raise TypeError("CQ(context, cqe, ...)")

    def poll(self, num_entries=1):
        return 0, []

    def close(self):
        pass
