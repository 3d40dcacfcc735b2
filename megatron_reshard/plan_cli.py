"""``megatron-reshard plan``: print the refit plan of a layout without any communication."""


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    return 2
