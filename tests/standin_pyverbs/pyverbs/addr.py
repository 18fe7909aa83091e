import re

_GID = re.compile(r"^[0-9a-fA-F]{4}(:[0-9a-fA-F]{4}){7}$")


class GID:
    """``GID(val)``: val in the eight-words form 'xxxx:xxxx:...' (pyverbs.utils.gid_str_to_array)."""

    def __init__(self, val=None):
        if val is not None and (not isinstance(val, str) or not _GID.match(val)):
            raise ValueError(f"invalid GID {val!r}")
        self._val = val or "0000:0000:0000:0000:0000:0000:0000:0000"

    def __str__(self):
        return self._val.lower()


class GlobalRoute:
    def __init__(self, dgid=None, flow_label=0, sgid_index=0, hop_limit=1, traffic_class=0):
        if not isinstance(dgid, GID):  # Cython: `GID dgid=None`, then dgid.gid is read
            raise TypeError(
                f"Argument 'dgid' has incorrect type (expected pyverbs.addr.GID, got {type(dgid).__name__})"
            )
        self.dgid, self.sgid_index, self.hop_limit = str(dgid), sgid_index, hop_limit


class AHAttr:
    def __init__(self, dlid=0, sl=0, src_path_bits=0, static_rate=0, is_global=0, port_num=1, gr=None):
        if gr is not None and not isinstance(gr, GlobalRoute):
            raise TypeError("Argument 'gr' has incorrect type (expected pyverbs.addr.GlobalRoute)")
        if is_global and gr is None:
            from .pyverbs_error import PyverbsUserError

            raise PyverbsUserError("Global AH Attr is created but gr parameter is None")
        self.dlid, self.is_global, self.port_num, self.gr = dlid, is_global, port_num, gr
