"""MTP: the model's own multi-token-prediction module drafts a chain, applied recursively to its own outputs
as vLLM and SGLang run DeepSeek-V3's and Qwen3-Next's; EAGLE's drafting loop runs it (a one-child tree)."""

from __future__ import annotations

from ..core.proposer import Drafter, chain_prefix
from ..heads.mtp import MtpHead
from ..registry import implementation, unless_sampled
from .eagle import Eagle, batch_drafting
from .eagle_trees import DynamicTree
from .resources import Resources


@implementation("mtp", nested=chain_prefix("num_draft_tokens"), graphed=unless_sampled, batched=True)
def build(params: dict, res: Resources, slots: int) -> Drafter:
    drafts = params.pop("num_draft_tokens", 3)
    sampled = params.pop("sampled", False)
    if params:
        raise ValueError(f"unknown parameters {', '.join(sorted(params))} (mtp takes num_draft_tokens, sampled)")
    if not isinstance(drafts, int) or drafts < 1:
        raise ValueError("mtp needs num_draft_tokens >= 1")
    head: MtpHead = res.head("mtp")  # importing heads.mtp registers the family
    return Eagle(
        head,
        head.logits,
        DynamicTree(total_tokens=drafts + 1, depth=drafts - 1, top_k=1),
        sampled=sampled,
        **batch_drafting(res, slots),
    )
