"""vLLM's SamplingParams and RequestOutputKind, as far as engine mode uses them."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
