"""Native MTP modules in the published layouts (scaled down): DeepSeek-V3 (`model.layers.{N}.*`, routed experts
one by one, in its own shard) and Qwen3-Next (`mtp.*`), checked against a forward computed by hand from the
stored tensors and a decoder layer of the target's class; the `mtp` method drafting through them."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from specbench import methods
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.proposer import Turn
from specbench.errors import SpecbenchError
from specbench.heads import mtp
from specbench.methods.vanilla import Vanilla

from .conftest import propose_one, random_llama

VOCAB, HIDDEN = 64, 32
PROMPT = [1, 5, 7, 9, 5, 7, 9, 11, 3]
DEEPSEEK = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_group=1,
    topk_group=1,
    tie_word_embeddings=False,
)
QWEN3_NEXT = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    tie_word_embeddings=False,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
)


def rms(x: torch.Tensor, weight: torch.Tensor, centred: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm by hand; Qwen3-Next scales by 1 + weight."""
    return (1 + weight if centred else weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def published(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A decoder layer's weights as checkpoints store them: routed experts one by one."""
    out = {}
    for key, value in layer.state_dict().items():
        if key.endswith("experts.gate_up_proj"):
            for e, fused in enumerate(value):
                gate, up = fused.chunk(2)
                out[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                out[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif key.endswith("experts.down_proj"):
            out.update({key.replace("down_proj", f"{e}.down_proj.weight"): w for e, w in enumerate(value)})
        else:
            out[key] = value
    return out


def write_checkpoint(folder: Path, target, config_key: str, stored: dict[str, torch.Tensor]) -> Path:
    """The target's own files plus an MTP shard and the index that maps every key to its shard."""
    target.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(folder / "model-mtp.safetensors"))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")  # noqa: SIM118
    weight_map.update(dict.fromkeys(stored, "model-mtp.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, config_key: 1}))
    return folder


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(folder, target, the donor's decoder layer and rotary embedding, the MTP-only tensors)."""
    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(DeepseekV3Config(num_hidden_layers=2, **DEEPSEEK)).eval()
    donor = DeepseekV3ForCausalLM(DeepseekV3Config(num_hidden_layers=3, **DEEPSEEK)).eval()  # layer 2: a MoE layer
    own = {
        "enorm.weight": torch.rand(HIDDEN) + 0.5,
        "hnorm.weight": torch.rand(HIDDEN) + 0.5,
        "eh_proj.weight": torch.randn(HIDDEN, 2 * HIDDEN) * 0.1,
        "shared_head.norm.weight": torch.rand(HIDDEN) + 0.5,
        "shared_head.head.weight": torch.randn(VOCAB, HIDDEN) * 0.3,
    }
    stored = {f"model.layers.2.{k}": v for k, v in {**published(donor.model.layers[2]), **own}.items()}
    folder = write_checkpoint(tmp_path_factory.mktemp("deepseek"), target, "num_nextn_predict_layers", stored)
    return folder, target, donor.model.layers[2], donor.model.rotary_emb, own


def test_deepseek_layout_matches_the_forward_by_hand(deepseek):
    folder, target, layer, rotary, own = deepseek
    head = mtp.load(str(folder), target).eval()
    features, tokens = torch.randn(1, 5, HIDDEN), torch.randint(0, VOCAB, (1, 5))
    positions = torch.arange(5)[None]
    with torch.no_grad():
        embedded = target.model.embed_tokens(tokens)
        embedded[:, 0] = 0  # position 0's embedding is zeroed (vLLM's deepseek_mtp)
        x = torch.cat([rms(embedded, own["enorm.weight"]), rms(features, own["hnorm.weight"])], -1)
        y = layer(x @ own["eh_proj.weight"].T, position_embeddings=rotary(x, positions), position_ids=positions)
        expected = rms(y, own["shared_head.norm.weight"]) @ own["shared_head.head.weight"].T
        torch.testing.assert_close(head.logits(head(features, tokens, positions)), expected)
    assert torch.equal(head.embed_tokens.weight, target.model.embed_tokens.weight)  # no embed_tokens stored


def test_qwen3_next_layout_matches_the_forward_by_hand(tmp_path):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    target = Qwen3NextForCausalLM(Qwen3NextConfig(**QWEN3_NEXT)).eval()
    donor = Qwen3NextForCausalLM(Qwen3NextConfig(**QWEN3_NEXT)).eval()
    own = {f"{n}.weight": torch.randn(HIDDEN) * 0.3 for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    own["fc.weight"] = torch.randn(HIDDEN, 2 * HIDDEN) * 0.1
    layer = {f"layers.0.{k}": v for k, v in published(donor.model.layers[1]).items()}  # a full-attention MoE layer
    stored = {f"mtp.{k}": v for k, v in {**layer, **own, "layers.1.fc.weight": torch.zeros(1)}.items()}
    folder = write_checkpoint(tmp_path, target, "mtp_num_hidden_layers", stored)
    head = mtp.load(str(folder), target).eval()  # module 1's keys are not read
    features, tokens = torch.randn(1, 5, HIDDEN), torch.randint(0, VOCAB, (1, 5))
    positions = torch.arange(5)[None]
    with torch.no_grad():
        embedded = target.model.embed_tokens(tokens)
        e = rms(embedded, own["pre_fc_norm_embedding.weight"], True)
        x = torch.cat([e, rms(features, own["pre_fc_norm_hidden.weight"], True)], -1) @ own["fc.weight"].T
        y = donor.model.layers[1](x, position_embeddings=donor.model.rotary_emb(x, positions), position_ids=positions)
        fed_back = rms(y, own["norm.weight"], True)  # Qwen3-Next feeds norm(y) back and reads out through lm_head
        torch.testing.assert_close(head(features, tokens, positions), fed_back)
        torch.testing.assert_close(head.logits(fed_back), target.lm_head(fed_back))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda raw, state: raw.pop("num_nextn_predict_layers"), "num_nextn_predict_layers .DeepSeek-V3. or mtp_num"),
        (lambda raw, state: raw.update(num_nextn_predict_layers=0), "num_nextn_predict_layers = 0: no MTP module"),
        (lambda raw, state: raw.update(hidden_size=64), "hidden size 64 .* the target has 32"),
        (lambda raw, state: state.pop("model.layers.2.hnorm.weight"), "key 'hnorm.weight' is missing"),
        (lambda raw, state: state.pop("model.layers.2.mlp.experts.3.up_proj.weight"), "experts under 'block.mlp"),
        (lambda raw, state: state.update({"model.layers.2.enorm.bias": torch.zeros(HIDDEN)}), "unexpected key 'enorm"),
        (
            lambda raw, state: state.update({"model.layers.2.eh_proj.weight_scale_inv": torch.ones(1)}),
            "FP8 block-quantised",
        ),
        (lambda raw, state: state.clear(), "no weights under 'model.layers.2.'"),
    ],
    ids=["no_count", "zero", "hidden", "missing", "experts", "extra", "fp8", "empty"],
)
def test_bad_checkpoints_are_one_line_errors(deepseek, tmp_path, edit, message):
    folder, target, *_ = deepseek
    raw = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model-mtp.safetensors"))
    edit(raw, state)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(state or {"other": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(SpecbenchError, match=message):
        mtp.load(str(tmp_path), target)


def resources(model, folder) -> methods.Resources:
    return methods.Resources("random", model, None, torch.device("cpu"), torch.float32, head_paths={"mtp": folder})


def greedy(model, proposer, n=24):
    return decode(CachedLM(model), proposer, PROMPT, max_new_tokens=n, temperature=0, stop_ids=set())


def test_deepseek_target_decodes_losslessly_with_its_mtp(deepseek):
    folder, target, *_ = deepseek
    reference = greedy(target, Vanilla()).tokens
    for name in ("mtp", "mtp[num_draft_tokens=1]"):
        result = greedy(target, methods.build(name, resources(target, folder)))
        assert result.tokens == reference, name


@pytest.fixture(scope="module")
def glm4_moe_lite(tmp_path_factory):
    """GLM-4.7-Flash scaled down and loaded from its folder: config.json as published (first_k_dense_replace, no
    mlp_layer_types) and an MTP module at model.layers.2 that passes the next token's embedding through a copy
    of the target's last layer and its readout. The random target is close to a bigram model (its layers add
    little to the embedding), so many drafts are accepted."""
    from transformers import AutoModelForCausalLM, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    torch.manual_seed(0)
    model = Glm4MoeLiteForCausalLM(Glm4MoeLiteConfig(num_hidden_layers=2, **DEEPSEEK)).eval()
    own = {
        "enorm.weight": torch.ones(HIDDEN),
        "hnorm.weight": torch.rand(HIDDEN) + 0.5,
        "eh_proj.weight": torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], 1),
        "shared_head.norm.weight": model.model.norm.weight.detach(),
        "shared_head.head.weight": model.lm_head.weight.detach(),
    }
    stored = {f"model.layers.2.{k}": v for k, v in {**published(model.model.layers[1]), **own}.items()}
    folder = write_checkpoint(tmp_path_factory.mktemp("glm4_moe_lite"), model, "num_nextn_predict_layers", stored)
    raw = json.loads((folder / "config.json").read_text())
    del raw["mlp_layer_types"]
    (folder / "config.json").write_text(json.dumps({**raw, "first_k_dense_replace": 1}))
    return folder, AutoModelForCausalLM.from_pretrained(folder).eval()


def test_glm4_moe_lite_target_decodes_losslessly_with_its_mtp(glm4_moe_lite):
    """The DeepSeek-V3 layout, with a MoE block although transformers decides dense or MoE by mlp_layer_types."""
    folder, target = glm4_moe_lite
    reference = greedy(target, Vanilla()).tokens
    for name in ("mtp", "mtp[num_draft_tokens=1]"):
        result = greedy(target, methods.build(name, resources(target, folder)))
        assert result.tokens == reference, name
        assert max(result.accept_lengths) > 1, name


@pytest.fixture(scope="module")
def llama_mtp(tmp_path_factory):
    """A random Llama and an MTP module for it written by `mtp.save` (compact: no embedding or readout)."""
    target = random_llama(VOCAB, hidden=HIDDEN, seed=0, init=0.3)
    torch.manual_seed(3)
    head = mtp.MtpHead(target, mtp.DEEPSEEK)
    for p in head.parameters():
        p.data.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("llama_mtp")
    mtp.save(head, target.config, folder, half=False, with_shared=False)
    return target, head, folder


def test_saved_module_loads_with_the_targets_embedding_and_readout(llama_mtp):
    target, head, folder = llama_mtp
    loaded = mtp.load(str(folder), target)
    assert torch.equal(loaded.fc.weight, head.fc.weight)
    assert torch.equal(loaded.block.mlp.gate_up.weight, head.block.mlp.gate_up.weight)  # (gate_proj, up_proj saved)
    assert torch.equal(loaded.head.weight, target.lm_head.weight)
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_cached_drafting_equals_recomputing_the_chain(llama_mtp):
    """The proposer feeds committed pairs once and drafts through its cache; recomputing the whole recursive
    chain from scratch at every step must give the same drafts."""
    target, _, folder = llama_mtp
    proposer = methods.build("mtp[num_draft_tokens=4]", resources(target, folder))
    head = proposer.head
    features = CachedLM(target).prefill(PROMPT, layers=(-1,)).features  # [n-1, H]: the states before the root
    proposer.start([0], [Turn(PROMPT, 0.0, features=features)])
    drafted = propose_one(proposer, PROMPT, 8).tree.tokens
    with torch.no_grad():
        states, tokens = features[None], list(PROMPT[1:])
        for _ in range(4):
            out = head(states, torch.tensor([tokens]), torch.arange(len(tokens))[None])  # causal, no cache
            tokens.append(int(head.logits(out[0, -1]).argmax()))
            states = torch.cat([features[None], out[:, len(PROMPT) - 2 :]], dim=1)
    assert drafted == tokens[len(PROMPT) - 1 :]


def test_llama_target_decodes_losslessly(llama_mtp):
    target, _, folder = llama_mtp
    reference = greedy(target, Vanilla()).tokens
    assert greedy(target, methods.build("mtp", resources(target, folder))).tokens == reference


def test_a_target_with_recurrent_layers_is_refused_in_one_line():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    with pytest.raises(SpecbenchError, match="has linear_attention layers, whose recurrent state"):
        CachedLM(Qwen3NextForCausalLM(Qwen3NextConfig(**QWEN3_NEXT)))
