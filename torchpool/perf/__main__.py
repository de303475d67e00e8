"""`python -m torchpool.perf ...`: the `perf` subcommand on its own."""
import argparse
import sys

from ..cli.errors import until_the_reader_goes
from .cli import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="torchpool perf",
                                     description="measure a model's throughput and latency under load")
    add_arguments(parser)
    return until_the_reader_goes(lambda: run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
