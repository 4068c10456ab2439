"""The bundled tiny model family (a Llama target, its draft and heads), the text heads train on, and the code that
trains the family.

Importing the package costs nothing: the training stack lives in `specbench.zoo.build`."""

from ..models.aliases import TINY_DIR

__all__ = ["TINY_DIR"]
