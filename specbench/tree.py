"""Token trees for method folders outside the package: `specbench.core.tree` under its earlier name."""

from .core.tree import *  # noqa: F403
from .core.tree import __all__  # noqa: F401
