"""The proposer interface for method folders outside the package: `specbench.core.proposer` under its earlier name."""

from ..core.proposer import *  # noqa: F403
from ..core.proposer import __all__  # noqa: F401
