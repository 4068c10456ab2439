"""vLLM's speculators format for EAGLE-3 heads and DFlash drafters: the tiny family's, converted there and back,
are byte-identical in their tensors and draft exactly as the originals in our loop; speculators heads load (their
norm_before_residual and fused layers read), unsupported variants are one line; `train eagle3 --format
speculators` writes the format; and, where the speculators package is installed, its own classes read what we
write."""

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specbench import methods
from specbench.cli.main import main
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.errors import SpecbenchError
from specbench.heads import dflash, eagle3, speculators
from specbench.heads.convert import convert
from specbench.methods.vanilla import Vanilla
from specbench.models import loading
from specbench.models.aliases import TINY_DIR
from specbench.models.chat import prompt_ids

from .conftest import random_llama

HEAD = TINY_DIR / "eagle3"
QUESTION = "Write a short story about a cat who learns to fly."


@pytest.fixture(scope="module", params=["eagle3", "dflash", "dflash2", "dspark"])
def converted(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(family, the tiny family's head of it in the speculators format, that converted back to the official
    layout)."""
    root = tmp_path_factory.mktemp("converted")
    there, back = root / "speculators", root / "official"
    head = TINY_DIR / request.param
    assert main(["convert", str(head), "--to", "speculators", "--out", str(there), "--target", "tiny"]) == 0
    assert main(["convert", str(there), "--to", "official", "--out", str(back)]) == 0
    return request.param, there, back


@pytest.fixture(scope="module")
def tiny_target():
    return loading.load_causal_lm(TINY_DIR / "target", torch.device("cpu"), torch.float32, "target")


def test_the_format_written_names_every_key_vllm_reads(converted):
    family, there, _ = converted
    if family != "eagle3":
        return _dflash_format(there, family)
    config = json.loads((there / "config.json").read_text())
    official = json.loads((HEAD / "config.json").read_text())
    layers = json.loads((TINY_DIR / "target" / "config.json").read_text())["num_hidden_layers"]
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["norm_before_residual"] is False  # written, not left to a reader's default
    assert config["draft_vocab_size"] == official["draft_vocab_size"] and config["target_hidden_size"] is None
    assert config["eagle_aux_hidden_state_layer_ids"] == list(eagle3.feature_layers(layers))
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert {k: layer[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "rope_theta")} == {
        k: official[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "rope_theta")
    }
    algorithm = config["speculators_config"]
    assert algorithm["algorithm"] == "eagle3" and algorithm["default_proposal_method"] == "greedy"
    assert algorithm["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert algorithm["proposal_methods"][0]["speculative_tokens"] >= 1
    state = load_file(str(there / "model.safetensors"))
    assert not any(k.startswith("midlayer.") for k in state) and "layers.0.self_attn.q_proj.weight" in state
    assert (there / "token_counts.json").is_file() and not (there.parent / "speculators.partial").exists()


def _dflash_format(there: Path, family: str) -> None:
    """z-lab's (DeepSpec's) layers, block and mask token, the layers read numbered from the embedding; DFlash2's
    convolution and selector keys and DSpark's Markov and confidence keys at the top level."""
    config = json.loads((there / "config.json").read_text())
    official = json.loads((TINY_DIR / family / "config.json").read_text())
    settings = official.get("dflash_config") or official  # (DeepSpec's keys are top-level)
    assert config["speculators_model_type"] == family and config["sample_from_anchor"] is (family == "dspark")
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in settings["target_layer_ids"]]
    assert config["mask_token_id"] == settings["mask_token_id"]
    assert config["block_size"] == settings["block_size"]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == official["num_hidden_layers"]
    assert not {"dflash_config", "block_size", "num_target_layers", "architectures"} & set(layer)
    extra = {"dflash2": speculators.DFLASH2_KEYS, "dspark": speculators.DSPARK_KEYS[:4]}.get(family, ())
    assert {k: config[k] for k in extra} == {k: settings[k] for k in extra} and not set(extra) & set(layer)
    tokens = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert tokens == config["block_size"] - (family != "dspark") and config["draft_vocab_size"] == layer["vocab_size"]


def test_the_round_trip_is_byte_identical_in_its_tensors(converted):
    family, _, back = converted
    original = load_file(str(TINY_DIR / family / "model.safetensors"))
    returned = load_file(str(back / "model.safetensors"))
    assert original.keys() == returned.keys()
    for key, tensor in original.items():
        assert tensor.dtype == returned[key].dtype and tensor.shape == returned[key].shape, key
        assert tensor.contiguous().view(torch.uint8).equal(returned[key].contiguous().view(torch.uint8)), key


def test_the_converted_head_drafts_exactly_as_the_original(converted, tiny_target):
    """Same tokens and the same accepted length at every step, greedy, in our loop."""
    family, there, _ = converted
    tokenizer = loading.load_tokenizer(TINY_DIR / "target")
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": QUESTION}])

    def decoded(proposer):
        return decode(CachedLM(tiny_target), proposer, prompt, max_new_tokens=24, temperature=0.0, stop_ids=set())

    def head(folder: Path):
        paths = {family: folder}
        return methods.build(
            family, methods.Resources("tiny", tiny_target, None, "cpu", torch.float32, head_paths=paths)
        )

    original, converted_gen = decoded(head(TINY_DIR / family)), decoded(head(there))
    assert converted_gen.tokens == original.tokens == decoded(Vanilla()).tokens
    assert converted_gen.accept_lengths == original.accept_lengths and max(original.accept_lengths) > 1


def _speculators_head(folder: Path, model, **config) -> Path:
    """A random speculators eagle3 head for `model` (the layout RedHatAI publishes), config keys overridden."""
    raw = {**json.loads((HEAD / "config.json").read_text())}
    vocab, hidden = model.get_output_embeddings().weight.shape
    raw.update(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, draft_vocab_size=vocab)
    raw.update(num_attention_heads=4, num_key_value_heads=2)
    head = eagle3.build(raw)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
    verifier = {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}
    speculators.save_eagle3(eagle3.saved_state(head), raw, folder, verifier, [2, 3, 4])
    written = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**written, **config}))
    return folder


def test_a_speculators_head_reads_its_residual_norm_and_fused_layers(tmp_path):
    model = random_llama(64, layers=7, seed=0, init=0.3)
    folder = _speculators_head(
        tmp_path / "h", model, norm_before_residual=True, eagle_aux_hidden_state_layer_ids=[1, 3, 6]
    )
    head = eagle3.load(str(folder), model)
    assert head.midlayer.norm_before_residual and head.layer_ids == (1, 3, 6)
    res = methods.Resources("random", model, None, torch.device("cpu"), torch.float32, head_paths={"eagle3": folder})
    proposer = methods.build("eagle3", res)
    assert proposer.feature_layers == (1, 3, 6)
    gen = decode(CachedLM(model), proposer, [1, 5, 7, 9], max_new_tokens=30, temperature=0.0, stop_ids=set())
    assert (
        gen.tokens
        == decode(CachedLM(model), Vanilla(), [1, 5, 7, 9], max_new_tokens=30, temperature=0.0, stop_ids=set()).tokens
    )
    # the residual is the normalised hidden state: the layer's output differs from the un-normalised one's
    x, e = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    rope = head.rotary(x, torch.arange(3)[None])
    normed = head.midlayer(e, x, rope, None, None)
    head.midlayer.norm_before_residual = False
    assert not torch.allclose(normed, head.midlayer(e, x, rope, None, None))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fc_norm": True, "norm_before_fc": True}, "sets both norm_before_fc and fc_norm"),
        ({"speculators_model_type": "dflash"}, "is a speculators 'dflash' checkpoint"),
        ({"transformer_layer_config": {"model_type": "qwen3", "num_hidden_layers": 1}}, "is a qwen3 layer"),
        ({"eagle_aux_hidden_state_layer_ids": [2, 4, 9]}, r"fuses target states \[2, 4, 9\], the target has 7"),
    ],
)
def test_what_our_head_cannot_run_is_one_line(tmp_path, change, message):
    model = random_llama(64, layers=7, seed=0, init=0.3)
    folder = _speculators_head(tmp_path / "h", model, **change)
    with pytest.raises(SpecbenchError, match=message):
        eagle3.load(str(folder), model)


@pytest.mark.parametrize("flag", ["norm_before_fc", "fc_norm", "norm_output"])
def test_an_eagle_3_1_head_computes_speculators_formulas_and_round_trips(tmp_path, flag):
    """EAGLE 3.1's options as speculators' `eagle3/core.py` computes them (L236-243, L302-306): `norm_before_fc` one
    RMSNorm over the fused target states before fc, `fc_norm` one per target state, `norm_output` the normed output
    fed back (and read out without a second norm). Each is checked against the plain head fed what the formula
    says, on the same weights; the head drafts vanilla's greedy tokens, and speculators -> official -> speculators
    keeps the flag and every tensor byte for byte."""
    model = random_llama(64, layers=7, seed=0, init=0.3)
    folder = _speculators_head(tmp_path / "h", model, **{flag: True})
    state = load_file(str(folder / "model.safetensors"))
    extra = {
        "norm_before_fc": {"input_norm.weight": (192,)},
        "fc_norm": {f"fc_norm.{i}.weight": (64,) for i in range(3)},
    }
    torch.manual_seed(1)
    state.update({k: torch.rand(shape) + 0.5 for k, shape in extra.get(flag, {}).items()})
    save_file(state, str(folder / "model.safetensors"))
    head = eagle3.load(str(folder), model)
    plain = copy.deepcopy(head)
    plain.input_norm, plain.fc_norm, plain.norm_output = None, None, False
    features, tokens, positions = torch.randn(1, 4, 192), torch.tensor([[3, 9, 4, 7]]), torch.arange(4)[None]
    eps = head.config.rms_norm_eps
    with torch.no_grad():
        ours = head(features, tokens, positions)
        if flag == "norm_before_fc":
            fed = torch.nn.functional.rms_norm(features, (192,), eps=eps) * state["input_norm.weight"]
        elif flag == "fc_norm":
            fed = torch.cat(
                [
                    torch.nn.functional.rms_norm(x, (64,), eps=eps) * state[f"fc_norm.{i}.weight"]
                    for i, x in enumerate(features.chunk(3, -1))
                ],
                -1,
            )
        else:
            fed = features
        theirs = plain(fed, tokens, positions)
        if flag == "norm_output":
            theirs = plain.norm(theirs)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(head.logits(ours), plain.logits(plain(fed, tokens, positions)), rtol=1e-5, atol=1e-5)
    res = methods.Resources("random", model, None, torch.device("cpu"), torch.float32, head_paths={"eagle3": folder})
    prompt = [1, 5, 7, 9]
    gen = decode(
        CachedLM(model), methods.build("eagle3", res), prompt, max_new_tokens=20, temperature=0.0, stop_ids=set()
    )
    assert (
        gen.tokens
        == decode(CachedLM(model), Vanilla(), prompt, max_new_tokens=20, temperature=0.0, stop_ids=set()).tokens
    )
    assert main(["convert", str(folder), "--to", "official", "--out", str(tmp_path / "o")]) == 0
    assert main(["convert", str(tmp_path / "o"), "--to", "speculators", "--out", str(tmp_path / "s")]) == 0
    assert json.loads((tmp_path / "s" / "config.json").read_text())[flag] is True
    back = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_convert_refuses_what_it_cannot_do(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "none"), "--to", "speculators", "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["convert", str(TINY_DIR / "eagle"), "--to", "speculators", "--out", str(tmp_path / "o")]) == 2
    assert "only EAGLE-3 and P-EAGLE heads and DFlash, DFlash2 and DSpark drafters convert" in capsys.readouterr().err
    assert main(["convert", str(HEAD), "--to", "official", "--out", str(tmp_path / "o")]) == 2
    assert "in the official layout already" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_train_writes_the_speculators_format(tmp_path, capsys):
    from specbench import tasks

    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for q in tasks.load("quick").questions for t in q.turns))
    out = tmp_path / "head"
    argv = ["train", "eagle3", "--target", "tiny", "--data", str(data), "--out", str(out), "--smoke", "--device", "cpu"]
    assert main([*argv, "--format", "speculators", "--draft-vocab", "500"]) == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 500
    assert config["speculators_config"]["verifier"]["name_or_path"].endswith("target")
    assert "layers.0.fc.weight" not in load_file(str(out / "model.safetensors"))
    assert (out / "accuracy.json").is_file() and (out / "token_counts.json").is_file()
    assert main(["train", "medusa", "--target", "tiny", "--out", str(tmp_path / "m"), "--format", "speculators"]) == 2
    assert "writes EAGLE-3 and P-EAGLE heads and DFlash, DFlash2 and DSpark drafters only" in capsys.readouterr().err


def test_the_speculators_package_reads_what_we_write(converted):
    """Its config registry validates our config.json and its model takes our tensors by name: none unexpected,
    none missing but those it fills from the verifier."""
    pytest.importorskip("speculators", reason="the speculators extra is not installed (transformers <= 5.19)")
    from speculators import SpeculatorModelConfig

    family, there, _ = converted
    config = SpeculatorModelConfig.from_pretrained(str(there))
    state = load_file(str(there / "model.safetensors"))
    if family == "eagle3":
        from speculators.convert.eagle.eagle3_legacy_model import Eagle3Speculator

        assert type(config).__name__ == "Eagle3SpeculatorConfig" and config.norm_before_residual is False
        model = Eagle3Speculator(config, verifier=None, verifier_attachment_mode="detached", reduce_vocab_size=True)
        filled = {"embed_tokens.weight"}
    else:
        from speculators.models.dflash import DFlashDraftModel
        from speculators.models.dflash2 import DFlash2DraftModel
        from speculators.models.dspark import DSparkDraftModel

        drafter = {"dflash": DFlashDraftModel, "dflash2": DFlash2DraftModel, "dspark": DSparkDraftModel}[family]
        assert type(config).__name__ == drafter.config_class.__name__
        assert config.block_size == json.loads((there / "config.json").read_text())["block_size"]
        model = drafter(config)
        filled = set(model._keys_to_ignore_on_load_missing)  # (a full-vocabulary drafter's adds its lm_head)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= filled, (missing, unexpected)


def test_the_speculators_round_trip_survives_a_stored_embedding(tmp_path):
    """A head that ships its own embedding (SpecForge's) keeps it through both conversions."""
    folder = tmp_path / "h"
    folder.mkdir()
    state = load_file(str(HEAD / "model.safetensors"))
    raw = json.loads((HEAD / "config.json").read_text())
    state["embed_tokens.weight"] = torch.randn(raw["vocab_size"], raw["hidden_size"]).half()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    convert(folder, "speculators", tmp_path / "s")
    convert(tmp_path / "s", "official", tmp_path / "o")
    back = load_file(str(tmp_path / "o" / "model.safetensors"))
    assert torch.equal(back["embed_tokens.weight"], state["embed_tokens.weight"])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"draft_vocab_size": 100}, "drafts over a vocabulary of its own"),
        ({"sample_from_anchor": True}, "sets sample_from_anchor True: a dflash variant this suite does not implement"),
        ({"aux_hidden_state_layer_ids": [0, 2]}, "needs aux_hidden_state_layer_ids, target layers from 1 up"),
        ({"speculators_model_type": "eagle3"}, "only dflash ones load as DFlash drafters"),
    ],
)
def test_what_our_dflash_drafter_cannot_run_is_one_line(tmp_path, tiny_target, change, message):
    folder = tmp_path / "d"
    convert(TINY_DIR / "dflash", "speculators", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(SpecbenchError, match=message):
        dflash.load(str(folder), tiny_target)
