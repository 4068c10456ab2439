"""`specbench`: parse, let outside method folders join, dispatch to the command's handler, and turn a user's
mistake into one line and exit status 2."""

from __future__ import annotations

import os
import sys

from ..errors import SpecbenchError
from . import handlers
from .parser import parser

COMMANDS = {
    "run": handlers.run,
    "lock": handlers.lock,
    "tune": handlers.tune,
    "verify": handlers.verify,
    "calibrate": handlers.calibrate,
    "merge": handlers.merge,
    "report": handlers.report,
    "export": handlers.export,
    "compare": handlers.compare,
    "list": handlers.list_,
    "train": handlers.train,
    "convert": handlers.convert,
    "regenerate": handlers.regenerate,
    "token-counts": handlers.token_counts,
    "zoo": handlers.zoo,
    "engine": handlers.engine,
}


def _add_user_methods() -> None:
    """Folders of method modules and presets named by $SPECBENCH_METHODS (separated like PATH) join the registry."""
    folders = [f for f in os.environ.get("SPECBENCH_METHODS", "").split(os.pathsep) if f]
    if folders:
        from .. import methods  # noqa: F401  (the built-in methods first)
        from ..registry import add_methods

        for folder in folders:
            add_methods(folder)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        _add_user_methods()
        return COMMANDS[args.command](args) or 0
    except SpecbenchError as err:
        print(f"specbench: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a reader that stopped early (e.g. `| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("\nspecbench: interrupted; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
