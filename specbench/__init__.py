"""specbench: a benchmark and evaluation suite for speculative decoding."""

__version__ = "0.1.0"
