"""The bundled tiny model family (a Llama target and its draft) and the code that trains it."""

from pathlib import Path

from specbench.zoo.build import build_family, continue_family, measure_family

TINY_DIR = Path(__file__).parent / "tiny"

__all__ = ["TINY_DIR", "build_family", "continue_family", "measure_family"]
