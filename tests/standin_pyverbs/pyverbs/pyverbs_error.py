class PyverbsError(Exception):
    pass


class PyverbsRDMAError(PyverbsError):
    def __init__(self, msg, error_code=0):
        super().__init__(msg)
        self.error_code = error_code


class PyverbsUserError(PyverbsError):
    pass
