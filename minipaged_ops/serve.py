"""``python -m minipaged_ops.serve --model DIR ...``: the OpenAI-compatible server (see
``minipaged_ops.integration.server``); ``minipaged serve ...`` is the same as a console script."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from minipaged_ops.integration.server import main as serve

    return serve(argv)


def cli(argv=None) -> int:
    """The ``minipaged`` console script: ``minipaged serve --model DIR ...``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: minipaged serve --model DIR [options]   (minipaged serve --help for the options)")
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"minipaged: unknown command {argv[0]!r}; the commands are: serve", file=sys.stderr)
        return 2
    from minipaged_ops.integration.server import main as serve

    return serve(argv[1:], prog="minipaged serve")


if __name__ == "__main__":
    sys.exit(main())
