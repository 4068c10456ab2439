"""The `specbench` command: a parser, one handler per command, a dispatch table."""

from .main import main

__all__ = ["main"]
