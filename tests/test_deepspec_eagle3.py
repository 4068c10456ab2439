"""DeepSpec's EAGLE-3 heads (`Qwen3Eagle3Model`, the matched baselines of its DSpark drafters) load as EAGLE-3 heads:
the key layout below is quoted from deepseek-ai/DeepSpec `deepspec/modeling/eagle3/qwen3/config.py`
(build_draft_config) and `modeling.py` (Qwen3Eagle3Model, Qwen3Eagle3DecoderLayer, Qwen3Eagle3Attention); DeepSpec
itself is not installable here, so its layers' forward is written out below and the loaded head must match it, for
heads of one layer (the released ones) and of two."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.errors import SpecbenchError
from specbench.heads import eagle3
from specbench.methods.eagle import Eagle
from specbench.methods.eagle_trees import DynamicTree
from specbench.methods.vanilla import Vanilla

from .conftest import random_llama

VOCAB, HIDDEN, LAYERS, HEADS, KV, DIM = 64, 64, 7, 4, 2, 16
TARGET_LAYER_IDS = [0, 1, 3, 4, 5]  # DeepSpec's numbering: hidden_states[i + 1]


@pytest.fixture(scope="module")
def llama():
    return random_llama(VOCAB, layers=LAYERS, hidden=HIDDEN, seed=0)


def deepspec_config(llama, layers: int = 1) -> dict:
    """build_draft_config: the target's config, then these keys."""
    return {
        **llama.config.to_dict(),
        "architectures": ["Qwen3Eagle3Model"],
        "num_target_layers": LAYERS,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention"] * layers,
        "target_model_name_or_path": "Qwen/Qwen3-8B",
        "target_layer_ids": TARGET_LAYER_IDS,
        "ttt_length": 7,
        "step_loss_decay": 0.8,
        "draft_num_hidden_layers": layers,
        "tie_word_embeddings": False,
        "head_dim": DIM,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
    }


def deepspec_state(seed: int = 1, std: float = 0.15, layers: int = 1) -> dict[str, torch.Tensor]:
    """Qwen3Eagle3Model's tensors: embed_tokens, fc (5H -> H), layers.{i}.{hidden_norm, input_layernorm,
    post_attention_layernorm, self_attn.{q,k,v,o}_proj (q/k/v read 2H), self_attn.{q,k}_norm, mlp}, norm, lm_head."""
    g = torch.Generator().manual_seed(seed)
    inner = 2 * HIDDEN  # (the target's intermediate_size, which the config copies)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1 + rand(n)

    return {
        "embed_tokens.weight": rand(VOCAB, HIDDEN),
        "fc.weight": rand(HIDDEN, 5 * HIDDEN),
        **{f"layers.{i}.{k}": v for i in range(layers) for k, v in layer_state(rand, norm, inner).items()},
        "norm.weight": norm(HIDDEN),
        "lm_head.weight": rand(VOCAB, HIDDEN),
    }


def layer_state(rand, norm, inner: int) -> dict[str, torch.Tensor]:
    """One Qwen3Eagle3DecoderLayer's tensors."""
    return {
        "hidden_norm.weight": norm(HIDDEN),
        "input_layernorm.weight": norm(HIDDEN),
        "post_attention_layernorm.weight": norm(HIDDEN),
        "self_attn.q_proj.weight": rand(HEADS * DIM, 2 * HIDDEN),
        "self_attn.k_proj.weight": rand(KV * DIM, 2 * HIDDEN),
        "self_attn.v_proj.weight": rand(KV * DIM, 2 * HIDDEN),
        "self_attn.o_proj.weight": rand(HIDDEN, HEADS * DIM),
        "self_attn.q_norm.weight": norm(DIM),
        "self_attn.k_norm.weight": norm(DIM),
        "mlp.gate_proj.weight": rand(inner, HIDDEN),
        "mlp.up_proj.weight": rand(inner, HIDDEN),
        "mlp.down_proj.weight": rand(HIDDEN, inner),
    }


def write(folder, config, state):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "model.safetensors"))
    return folder


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_logits(config, state, features, tokens):
    """Qwen3Eagle3Model.forward (each Qwen3Eagle3DecoderLayer.forward in turn, every one reading the token's
    embedding beside the hidden state) and compute_logits written out, causal, no cache."""
    s, eps, n = state, config["rms_norm_eps"], tokens.shape[1]
    hidden = features @ s["fc.weight"].T  # project_hidden_states
    embedded = s["embed_tokens.weight"][tokens]
    layers = config["num_hidden_layers"]
    cos, sin = LlamaRotaryEmbedding(
        eagle3.config_of({**config, "draft_vocab_size": VOCAB, "draft_layers": layers}, "x")
    )(hidden, torch.arange(n)[None])
    for i in range(layers):
        w = {k[len(f"layers.{i}.") :]: v for k, v in s.items() if k.startswith(f"layers.{i}.")}
        residual = hidden
        x = torch.cat([rms(embedded, w["input_layernorm.weight"], eps), rms(hidden, w["hidden_norm.weight"], eps)], -1)
        q = (x @ w["self_attn.q_proj.weight"].T).view(1, n, HEADS, DIM)
        k = (x @ w["self_attn.k_proj.weight"].T).view(1, n, KV, DIM)
        v = (x @ w["self_attn.v_proj.weight"].T).view(1, n, KV, DIM).transpose(1, 2)
        q = rms(q, w["self_attn.q_norm.weight"], eps).transpose(1, 2)
        k = rms(k, w["self_attn.k_norm.weight"], eps).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        hidden = residual + attended.transpose(1, 2).reshape(1, n, HEADS * DIM) @ w["self_attn.o_proj.weight"].T
        y = rms(hidden, w["post_attention_layernorm.weight"], eps)
        mlp = torch.nn.functional.silu(y @ w["mlp.gate_proj.weight"].T) * (y @ w["mlp.up_proj.weight"].T)
        hidden = hidden + mlp @ w["mlp.down_proj.weight"].T
    return rms(hidden, s["norm.weight"], eps) @ s["lm_head.weight"].T


@torch.no_grad()
@pytest.mark.parametrize("layers", [1, 2])
def test_the_head_loads_and_its_forward_is_deepspecs(tmp_path, llama, layers):
    config, state = deepspec_config(llama, layers), deepspec_state(layers=layers)
    head = eagle3.load(write(tmp_path / "h", config, state), llama).eval()
    assert head.layer_ids == tuple(i + 1 for i in TARGET_LAYER_IDS) and head.feature_size == 5 * HIDDEN
    assert head.d2t is None and head.midlayer.self_attn.q_norm is not None and len(head.layers) == layers - 1
    features, tokens = torch.randn(1, 9, 5 * HIDDEN), torch.randint(0, VOCAB, (1, 9))
    ours = head.logits(head(features, tokens, torch.arange(9)[None]))
    torch.testing.assert_close(ours, reference_logits(config, state, features, tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layers", [1, 2])
def test_it_drafts_greedy_identical_to_vanilla(tmp_path, llama, layers):
    state = deepspec_state(layers=layers)
    head = eagle3.load(write(tmp_path / "h", deepspec_config(llama, layers), state), llama).eval()
    prompt = [1, 5, 7, 9, 5, 7, 9, 11, 3]
    reference = decode(CachedLM(llama), Vanilla(), prompt, max_new_tokens=24, temperature=0.0, stop_ids=set())
    accepted = []
    for static in (False, True):  # the head's own cache, and the static rows a batch and --graphs draft on
        tree = DynamicTree(top_k=3, depth=3, total_tokens=8)
        drafting = Eagle(head, head.logits, tree, feature_layers=head.layer_ids, static=static)
        ours = decode(CachedLM(llama), drafting, prompt, max_new_tokens=24, temperature=0.0, stop_ids=set())
        assert ours.tokens == reference.tokens and max(s.tree_size for s in ours.steps) > 1
        accepted.append(ours.accept_lengths)
    assert accepted[0] == accepted[1]  # (the same drafts on either cache)


def test_heads_without_layers_or_layer_ids_are_one_line(tmp_path, llama):
    with pytest.raises(SpecbenchError, match="config.json needs num_hidden_layers"):
        eagle3.load(write(tmp_path / "zero", deepspec_config(llama, layers=0), deepspec_state()), llama)
    config = {k: v for k, v in deepspec_config(llama).items() if k != "target_layer_ids"}
    with pytest.raises(SpecbenchError, match="config.json needs target_layer_ids"):
        eagle3.load(write(tmp_path / "none", config, deepspec_state()), llama)
