"""A stand-in process group that cannot communicate: proves code paths stay local."""


class NoCommGroup:
    """Knows its rank and size (and reports a gloo backend); has no communication methods,
    so any attempt to send, receive or reduce through it raises AttributeError."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def name(self) -> str:
        return "gloo"
