"""Head checkpoints in the official layouts (scaled down): Medusa .pt/.safetensors, EAGLE-1/2 .bin/.safetensors."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specbench import methods
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.errors import SpecbenchError
from specbench.heads import eagle as eagle_heads
from specbench.heads import medusa as medusa_heads
from specbench.heads.checkpoint import target_signature
from specbench.methods.vanilla import Vanilla

from .conftest import random_llama

VOCAB, HIDDEN = 64, 64
PROMPT = [1, 5, 7, 9, 5, 7, 9, 11, 3]

# EAGLE-Vicuna-7B-v1.3's config.json key set, scaled down (no num_key_value_heads: it defaults to the heads).
EAGLE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": 2 * HIDDEN,
    "max_position_embeddings": 1024,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.28.1",
    "use_cache": True,
    "vocab_size": VOCAB,
}
EAGLE_KEYS = {
    "embed_tokens.weight": [VOCAB, HIDDEN],
    "fc.weight": [HIDDEN, 2 * HIDDEN],
    "fc.bias": [HIDDEN],
    "layers.0.self_attn.q_proj.weight": [HIDDEN, HIDDEN],
    "layers.0.self_attn.k_proj.weight": [HIDDEN, HIDDEN],
    "layers.0.self_attn.v_proj.weight": [HIDDEN, HIDDEN],
    "layers.0.self_attn.o_proj.weight": [HIDDEN, HIDDEN],
    "layers.0.mlp.gate_proj.weight": [2 * HIDDEN, HIDDEN],
    "layers.0.mlp.up_proj.weight": [2 * HIDDEN, HIDDEN],
    "layers.0.mlp.down_proj.weight": [HIDDEN, 2 * HIDDEN],
    "layers.0.post_attention_layernorm.weight": [HIDDEN],
}


@pytest.fixture(scope="module")
def target():
    return random_llama(VOCAB, seed=0, init=0.3)


def resources(model, head) -> methods.Resources:
    heads = {family: Path(head) for family in ("medusa", "eagle", "eagle3")} if head else {}
    return methods.Resources("random", model, None, torch.device("cpu"), torch.float32, None, heads)


def greedy(model, proposer, prompt=PROMPT, n=30):
    return decode(CachedLM(model), proposer, prompt, max_new_tokens=n, temperature=0, stop_ids=set())


def medusa_state(num_heads: int, own_projection: bool = True) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    state = {}
    for i in range(num_heads):
        state[f"{i}.0.linear.weight"] = torch.randn(HIDDEN, HIDDEN) * 0.02
        state[f"{i}.0.linear.bias"] = torch.zeros(HIDDEN)
        if own_projection:
            state[f"{i}.1.weight"] = torch.randn(VOCAB, HIDDEN) * 0.02
    return state


def write_medusa(folder, state, name="medusa_lm_head.pt"):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps({"base_model_name_or_path": "x", "medusa_num_heads": 2, "medusa_num_layers": 1})
    )
    if name.endswith(".pt"):
        torch.save({k: v.to(torch.bfloat16) for k, v in state.items()}, folder / name)
    else:
        save_file(state, str(folder / name))
    return folder


@pytest.mark.parametrize("name", ["medusa_lm_head.pt", "medusa_lm_head.safetensors"])
@pytest.mark.parametrize("own_projection", [True, False], ids=["v1", "shared_lm_head"])
def test_medusa_layouts_load_and_decode(tmp_path, target, name, own_projection):
    folder = write_medusa(tmp_path / "m", medusa_state(5, own_projection), name)
    heads = medusa_heads.load(str(folder))
    assert len(heads) == 5 and heads.shared_lm_head is not own_projection  # 5 heads in the file, 2 in the config
    proposer = methods.build("medusa", resources(target, str(folder)))
    assert greedy(target, proposer).tokens == greedy(target, Vanilla()).tokens


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda s: s.update({"2.0.linear.b": s.pop("2.0.linear.bias")}), "2.0.linear.bias"),
        (lambda s: s.update({"1.1.weight": torch.zeros(VOCAB + 1, HIDDEN)}), "1.1.weight"),
        (lambda s: s.update({"0.2.weight": torch.zeros(1)}), "0.2.weight"),
        (lambda s: s.pop("0.0.linear.weight"), "0.0.linear.weight"),
    ],
    ids=["renamed", "shape", "extra", "missing"],
)
def test_medusa_bad_layout_names_the_key(tmp_path, edit, key):
    state = medusa_state(5)
    edit(state)
    folder = write_medusa(tmp_path / "m", state, "medusa_lm_head.safetensors")
    with pytest.raises(SpecbenchError, match=key.replace(".", r"\.")):
        medusa_heads.load(str(folder))


def test_medusa_tree_deeper_than_heads_is_an_error(tmp_path, target):
    folder = write_medusa(tmp_path / "m", medusa_state(3))
    with pytest.raises(SpecbenchError, match="4 deep but the checkpoint has 3 heads"):
        methods.build("medusa", resources(target, str(folder)))
    methods.build("medusa", resources(target, str(folder)), {"tree": [[0], [1], [0, 0], [0, 0, 0]]})


def test_medusa_heads_for_another_target_are_an_error(tmp_path):
    folder = write_medusa(tmp_path / "m", medusa_state(5))
    with pytest.raises(SpecbenchError, match="hidden size 64"):
        methods.build("medusa", resources(random_llama(VOCAB, hidden=32), str(folder)))


def eagle_state(bias: bool, embed: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    state = {k: torch.randn(shape) * 0.05 for k, shape in EAGLE_KEYS.items()}
    state["layers.0.post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    if not bias:
        del state["fc.bias"]
    if not embed:
        del state["embed_tokens.weight"]
    return state


def write_eagle(folder, state, bias: bool, name: str):
    folder.mkdir(exist_ok=True)
    config = {**EAGLE_CONFIG, **({} if bias else {"bias": False})}  # official heads with a bias omit the key
    (folder / "config.json").write_text(json.dumps(config))
    if name == "pytorch_model.bin":
        torch.save(state, folder / name)
    else:
        save_file(state, str(folder / name))
    return folder


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("embed", [True, False], ids=["embed", "no_embed"])
def test_eagle_layouts_load_and_decode(tmp_path, target, name, bias, embed):
    """The official EAGLE-1/2 layouts; HASS's published heads (HArmonizedSS/HASS-*) are the no-bias one with its
    embedding, in pytorch_model.bin."""
    state = eagle_state(bias, embed)
    folder = write_eagle(tmp_path / "e", state, bias, name)
    head = eagle_heads.load(str(folder), target)
    assert set(head.state_dict()) == set(EAGLE_KEYS) - (set() if bias else {"fc.bias"})
    assert torch.equal(head.fc.weight, state["fc.weight"])
    expected_embed = state["embed_tokens.weight"] if embed else target.get_input_embeddings().weight
    assert torch.equal(head.embed_tokens.weight, expected_embed)
    reference = greedy(target, Vanilla()).tokens
    for method in ("eagle", "eagle2"):
        assert greedy(target, methods.build(method, resources(target, str(folder)))).tokens == reference, method


@pytest.mark.parametrize(
    "edit, bias, key",
    [
        (lambda s: s.update({"layers.0.input_layernorm.weight": torch.ones(HIDDEN)}), True, "input_layernorm"),
        (lambda s: s.update({"fc.weight": torch.zeros(HIDDEN, HIDDEN)}), True, "fc.weight"),
        (lambda s: s.pop("layers.0.mlp.up_proj.weight"), True, "layers.0.mlp.up_proj.weight"),
        (lambda s: None, False, "fc.bias"),  # trained with a bias, config says "bias": false (EAGLE issue #100)
    ],
    ids=["extra", "shape", "missing", "bias_mismatch"],
)
def test_eagle_bad_layout_names_the_key(tmp_path, target, edit, bias, key):
    state = eagle_state(bias=True, embed=True)
    edit(state)
    folder = write_eagle(tmp_path / "e", state, bias, "model.safetensors")
    with pytest.raises(SpecbenchError, match=key.replace(".", r"\.")):
        eagle_heads.load(str(folder), target)


def test_a_griffin_head_is_refused_naming_its_fusion_block(tmp_path, target):
    """GRIFFIN (husj576/GRIFFIN-*) replaces fc by a token-guided fusion block (`fc.fc`, `fc.mlp`, ...)."""
    state = eagle_state(bias=True, embed=True)
    state["fc.fc.weight"], state["fc.fc.bias"] = state.pop("fc.weight"), state.pop("fc.bias")
    folder = write_eagle(tmp_path / "g", state, True, "pytorch_model.bin")
    with pytest.raises(SpecbenchError, match=r"GRIFFIN head \(key 'fc\.fc\.weight'") as err:
        eagle_heads.load(str(folder), target)
    assert "\n" not in str(err.value)


def test_eagle_head_for_another_target_is_an_error(tmp_path):
    folder = write_eagle(tmp_path / "e", eagle_state(True, True), True, "model.safetensors")
    with pytest.raises(SpecbenchError, match="use a head trained for this target"):
        eagle_heads.load(str(folder), random_llama(VOCAB, hidden=32))


def test_missing_head_says_how_to_get_one(tmp_path, target):
    res = resources(target, None)
    with pytest.raises(SpecbenchError, match="--head"):
        methods.build("eagle", res)
    res = methods.Resources("tiny", target, None, "cpu", torch.float32, head_paths={"eagle": tmp_path / "none"})
    with pytest.raises(SpecbenchError, match="specbench train eagle"):
        methods.build("eagle2", res)
    with pytest.raises(SpecbenchError, match="none of medusa_lm_head.safetensors, medusa_lm_head.pt"):
        medusa_heads.load(str(tmp_path))


def test_head_trained_for_another_version_of_the_target_warns(tmp_path, target, capsys):
    folder = write_eagle(tmp_path / "e", eagle_state(True, True), True, "model.safetensors")
    other = random_llama(VOCAB, seed=1, init=0.3)  # same shapes, retrained weights
    (folder / "accuracy.json").write_text(json.dumps({"target_signature": target_signature(other)}))
    methods.build("eagle2", resources(target, str(folder)))
    assert "trained for a different version of target 'random'" in capsys.readouterr().err
    (folder / "accuracy.json").write_text(json.dumps({"target_signature": target_signature(target)}))
    methods.build("eagle2", resources(target, str(folder)))
    assert capsys.readouterr().err == ""


def test_target_signature_survives_float16_but_not_retraining(target):
    half = random_llama(VOCAB, seed=0, init=0.3).half()
    half.get_input_embeddings().weight.data.copy_(target.get_input_embeddings().weight.half())
    assert target_signature(half) == target_signature(target)
    assert target_signature(random_llama(VOCAB, seed=1, init=0.3)) != target_signature(target)
    assert target_signature(random_llama(VOCAB, seed=0, init=0.3).to(torch.bfloat16)) is None
