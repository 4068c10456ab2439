"""The bundled tiny model family (a Llama target, its draft and heads) and, in its modules, the code that trains it.

Importing the package costs nothing: the training stack lives in `specbench.zoo.build`."""

from pathlib import Path

TINY_DIR = Path(__file__).parent / "tiny"

__all__ = ["TINY_DIR"]
