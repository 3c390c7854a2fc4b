"""The one exception of the rm-core boundary."""


class ContractError(ValueError):
    """A value does not satisfy an rm-core contract.

    The message names the field, what was expected and what was got, e.g.
    ``MemoryTier.capacity_bytes: expected an integer >= 0, got -1``.
    """

    def __init__(self, field: str, expected: str, got: object):
        self.field = field
        self.expected = expected
        self.got = got
        super().__init__(f"{field}: expected {expected}, got {got!r}")
