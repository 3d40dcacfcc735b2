"""Test support: count the engine's agreement votes in this process (a spy: the real
vote still runs)."""

from megatron_reshard.engine import agree as agree_module


class VoteCount:
    """``with VoteCount() as counted: ...``; ``counted.count`` votes started so far."""

    def __enter__(self):
        self.real, self.count = agree_module.start, 0

        def start(*args, **kwargs):
            self.count += 1
            return self.real(*args, **kwargs)

        agree_module.start = start
        return self

    def __exit__(self, *exc):
        agree_module.start = self.real
