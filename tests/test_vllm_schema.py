"""Every preset's vLLM mapping, and each value of a parameter it carries through a table, against vLLM's own
`SpeculativeConfig`: its method names and the settings a user gives, quoted below from vLLM's source (vLLM runs on
a GPU, not here: this is what can be checked without it).

SOURCE: vllm-project/vllm, vllm/config/speculative.py at 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443 (read
2026-11-30): `SpeculativeMethod` (with `EagleModelTypes`, `MTPModelTypes`' "mtp", `DFlashModelTypes`,
`DSparkModelTypes`, `NgramGPUTypes`), the dataclass's fields, `DraftSampleMethod`, and the field docs:
`parallel_drafting` "Only compatible with EAGLE and draft model methods", `enable_adaptive_verification`
"Currently only supported for method="dspark"", `num_speculative_tokens` Field(gt=0), `prompt_lookup_max` and
`prompt_lookup_min` Field(ge=1)."""

from pathlib import Path

import pytest

from specbench import methods
from specbench.engines import translate

METHODS = {
    "ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "eagle", "eagle3",
    "extract_hidden_states", "mtp", "dflash", "ngram_gpu", "dspark",
}  # fmt: skip
EAGLE_TYPES = {"eagle", "eagle3", "extract_hidden_states", "mtp", "dflash"}  # EagleModelTypes (MTP's own types aside)
FIELDS = {
    "enforce_eager", "num_speculative_tokens", "model", "method", "draft_tensor_parallel_size", "quantization",
    "moe_backend", "attention_backend", "kv_cache_dtype", "max_model_len", "revision", "code_revision",
    "index_share_for_mtp_iteration", "disable_padded_drafter_batch", "disable_eagle_block_drop",
    "use_local_argmax_reduction", "use_heterogeneous_vocab", "prompt_lookup_max", "prompt_lookup_min",
    "parallel_drafting", "num_speculative_tokens_per_batch_size", "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
    "draft_load_config", "rejection_sample_method", "synthetic_acceptance_rates", "synthetic_acceptance_length",
    "enable_adaptive_verification", "draft_sample_method", "dspark_draft_topk",
}  # fmt: skip


def mapped() -> list[str]:
    """Every preset with a vLLM mapping, and a variant for each value of a parameter it carries through a table
    (`{$verify: {all: null, adaptive: true}}`), those vLLM can run."""
    names = []
    for name in methods.available():
        found = translate.mapping(name, "vllm")
        if not isinstance(found, dict) or not found:  # (vanilla's empty one: plain decoding)
            continue
        names.append(name)
        for value in found.values():
            if (param := translate._param(value)) and isinstance(value, dict):
                names += [f"{name}[{param}={choice}]" for choice in value[f"${param}"] if choice != "all"]
    return [name for name in names if translate.why_not(name) is None]


@pytest.mark.parametrize("name", mapped())
def test_each_mapping_is_a_speculative_config_vllm_accepts(name):
    paths = {f"{n.key} head" if n.kind == "head" else n.kind: Path(f"/{n.kind}") for n in methods.needs(name)}
    paths.setdefault("draft", Path("/draft"))
    config = translate.speculative_config(name, paths)
    assert config is not None and accepted(config) == []


def accepted(config: dict) -> list[str]:
    """What vLLM's SpeculativeConfig would refuse in `config` (nothing: [])."""
    method = config.get("method")
    problems = [f"unknown setting {key}" for key in set(config) - FIELDS]
    problems += [] if method in METHODS else [f"unknown method {method}"]
    tokens = config.get("num_speculative_tokens", 1)
    problems += [] if isinstance(tokens, int) and tokens > 0 else ["num_speculative_tokens"]
    if config.get("parallel_drafting") and method not in EAGLE_TYPES | {"draft_model"}:
        problems.append("parallel_drafting")
    if "enable_adaptive_verification" in config and method != "dspark":
        problems.append("enable_adaptive_verification")
    problems += [] if config.get("draft_sample_method", "greedy") in ("greedy", "probabilistic") else ["sampling"]
    for key in ("prompt_lookup_max", "prompt_lookup_min"):
        problems += [] if isinstance(config.get(key, 1), int) and config.get(key, 1) >= 1 else [key]
    if ("model" in config) != (method not in ("ngram", "suffix", "ngram_gpu")):
        problems.append("model")
    return problems


def test_a_planted_mistake_is_refused():
    good = {"method": "dspark", "model": "/d", "num_speculative_tokens": 7, "enable_adaptive_verification": True}
    assert accepted(good) == []
    assert accepted({**good, "method": "dflash"}) == ["enable_adaptive_verification"]
    assert accepted({**good, "adaptive_verification": True}) == ["unknown setting adaptive_verification"]
    assert accepted({"method": "ngram", "num_speculative_tokens": 3, "parallel_drafting": True}) == [
        "parallel_drafting"
    ]


def test_the_2026_drafters_are_among_them():
    assert {"dspark", "dspark[verify=adaptive]", "dflash2", "peagle", "dflash"} <= set(mapped())
