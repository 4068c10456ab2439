"""Vanilla autoregressive decoding: the shared loop with an empty proposal, one token per target forward."""

from __future__ import annotations

from .base import Proposer


class Vanilla(Proposer):
    name = "vanilla"
