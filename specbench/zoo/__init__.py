"""The bundled tiny model family (a Llama target, its draft and heads), the text heads train on, and the code that
trains the family.

Importing the package costs nothing: the training stack lives in `specbench.zoo.build`."""

from pathlib import Path

from ..errors import SpecbenchError
from ..models.aliases import TINY_DIR

HISTORY = "training_log.json"  # a family folder's record of its training runs


def check_family(folder: Path) -> None:
    """A trained family's folder (its record and target), checked before the training stack loads."""
    if not (folder / HISTORY).is_file() or not (folder / "target" / "config.json").is_file():
        raise SpecbenchError(
            f"{folder} holds no trained tiny family ({HISTORY} and target/): build it first with `specbench zoo build`"
        )


__all__ = ["HISTORY", "TINY_DIR", "check_family"]
