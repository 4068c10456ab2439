"""Vanilla autoregressive decoding: the shared loop with an empty proposal, one token per target forward."""

from __future__ import annotations

from ..core.proposer import Proposer
from ..registry import implementation
from .resources import Resources


class Vanilla(Proposer):
    """Proposes nothing: every step verifies the root alone and keeps the target's token."""


@implementation("vanilla")
def build(params: dict, res: Resources) -> Proposer:
    return Vanilla(**params)
