"""vLLM's per-request counts read as our loop's steps, so answers and sweeps from vLLM carry the same fields."""

from __future__ import annotations


def step_lengths(new_tokens: int, accepted: list[int], drafted: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Per target forward of one vLLM request, as our loop records them: tokens gained, draft depth examined
    (`tested`: the accepted drafts plus the rejected one) and tokens sent (the drafts plus one). The prefill's token
    comes first (a forward that drafted nothing), then each speculative step's accepted drafts plus its own token,
    the last cut at the answer's length (vLLM counts drafts accepted past a stop token or the budget); tokens left
    over came from forwards without a draft, which vLLM does not list."""
    lengths, tested, sent, left = [], [], [], new_tokens
    for a, d in zip([0, *accepted], [0, *drafted], strict=True):
        if left <= 0:
            break
        lengths.append(min(a + 1, left))
        tested.append(min(d, a + 1))
        sent.append(d + 1)
        left -= lengths[-1]
    return lengths + [1] * left, tested + [0] * left, sent + [1] * left
