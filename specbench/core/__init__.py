"""The decode loop and its math: the proposer types, one verification step, the acceptance rules, token trees,
sampling, the target's KV cache and the losslessness audits. Nothing here names a method, a model or a run."""
