"""The owned decoder (`models.decoder`) computes what transformers computes, on transformers' own weights: float32
logits and hidden states within 1e-5 (relative) for the tiny family and miniature random Llama-3.1 (rope scaling),
Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms); SmolLM2 through its GGUF is in test_smollm2.py. It
shares the weights (no second copy) and refuses what it cannot run with the reason."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specbench.core import cached_lm
from specbench.core.cached_lm import CachedLM, top1, top_two
from specbench.core.one_slot import OneSlot
from specbench.core.static_lm import BatchedLM, Inputs, Row
from specbench.core.tree import Tree, additive
from specbench.models.decoder import Decoder, unsupported
from specbench.models.loading import load_causal_lm
from specbench.zoo import TINY_DIR

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def mini(kind: str, seed: int = 0, **extra) -> torch.nn.Module:
    """A random miniature of an architecture (grouped-query attention: 4 query heads, 2 key/value heads), with
    weights large enough that its logits are far from uniform."""
    config = AutoConfig.for_model(
        kind,
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


MINIS = {
    "llama-3.1": lambda: mini("llama", rope_parameters=LLAMA31_ROPE),
    "mistral": lambda: mini("mistral", sliding_window=None),
    "qwen2": lambda: mini("qwen2", use_sliding_window=False),
    "qwen3": lambda: mini("qwen3", head_dim=32, use_sliding_window=False),
}


def assert_same_as_transformers(model: torch.nn.Module, vocab: int) -> None:
    """Logits and hidden states (embeddings, a middle layer's output, the last one's, the final state) of a
    20-token prompt, then of a tree over its cache, equal transformers' within 1e-5 relative."""
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (1, 20))
    layers = model.config.get_text_config().num_hidden_layers
    features = (0, min(2, layers), layers, -1)
    with torch.no_grad():
        theirs = model(ids, output_hidden_states=True)
        owned = Decoder.adopt(model)
        final, ours = owned(ids, torch.arange(20)[None], None, None, features)
    scale = theirs.logits.abs().max()
    assert (owned.readout(final) - theirs.logits).abs().max() <= 1e-5 * scale
    wanted = torch.cat([theirs.hidden_states[i] for i in features], dim=-1)
    assert (ours - wanted).abs().max() <= 1e-5 * wanted.abs().max()
    eager, static = OneSlot(CachedLM(model)), BatchedLM(owned, capture=False)
    tree = Tree([3, 4, 5, 6], [-1, -1, 1, 1])
    for lm in (eager, static):
        lm.prefill([0], [ids[0].tolist()])
    a, b = (
        lm.run([Row(0, tree.rows(int(ids[0, -1])), tree)], layers=(min(2, layers), -1))[0] for lm in (eager, static)
    )
    assert (a.logits - b.logits).abs().max() <= 1e-5 * a.logits.abs().max()
    assert (a.features - b.features).abs().max() <= 1e-5 * a.features.abs().max()


@pytest.mark.parametrize("name", sorted(MINIS))
def test_a_miniature_of_each_architecture_gives_transformers_logits(name):
    model = MINIS[name]()
    assert unsupported(model) is None
    assert_same_as_transformers(model, 300)


@pytest.mark.parametrize("part", ["target", "draft", "pard"])
def test_the_tiny_family_gives_transformers_logits(part):
    model = load_causal_lm(TINY_DIR / part, torch.device("cpu"), torch.float32, part)
    assert_same_as_transformers(model, model.config.vocab_size)


def test_adopting_shares_the_weights_and_leaves_the_transformers_model_working():
    model = mini("qwen2", use_sliding_window=False)
    ids = torch.randint(0, 300, (1, 9))
    with torch.no_grad():
        before = model(ids).logits
    owned = Decoder.adopt(model)
    ours = {p.untyped_storage().data_ptr() for p in owned.parameters()}
    after = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert after == ours  # every transformers weight is one of ours (the fused products' views), none held twice
    size = sum(p.numel() for p in owned.parameters())
    assert size == sum(p.numel() for p in model.parameters())  # (tied or not, the same count of numbers)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (lambda: mini("gpt2"), "outside the Llama family"),
        (
            lambda: mini("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
            "changes with the sequence's length",
        ),
        (lambda: mini("mistral", sliding_window=64), "slides over 64 tokens"),
        (lambda: mini("llama", hidden_act="gelu"), "not SiLU"),
    ],
)
def test_what_it_cannot_run_is_refused_with_the_reason(model, reason):
    built = model()
    assert reason in unsupported(built)
    with pytest.raises(ValueError, match=reason):
        Decoder.adopt(built)


def test_no_module_reads_transformers_source():
    """The fast regime owns its decoder: nothing in the package parses or reads another library's source."""
    package = Path(__file__).parent.parent / "specbench"
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("getsource", "getsourcelines"):
                raise AssertionError(f"{path.relative_to(package)} reads source with inspect.{node.attr}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert "ast" not in names, f"{path.relative_to(package)} imports ast"


@pytest.mark.parametrize("name", sorted(MINIS))
def test_a_layer_built_for_a_family_loads_its_transformers_layer_and_computes_the_same(name):
    """`Layer.build` lays a fresh layer out as the family does (Qwen2's biased q/k/v, Qwen3's per-head norms), so a
    head built on it (an MTP block) loads the family's checkpoint keys and computes what the transformers layer
    computes, within 1e-5 relative; its state dict is that layer's, names and tensors."""
    from specbench.models.decoder import Layer

    model = MINIS[name]()
    config, theirs = model.config, model.model.layers[1]
    ours = Layer.build(config, 1)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for key, tensor in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], tensor, rtol=0, atol=0)
    torch.manual_seed(1)
    x, positions = torch.randn(1, 7, config.hidden_size), torch.arange(7)[None]
    rope = model.model.rotary_emb(x, positions)
    with torch.no_grad():
        expected = theirs(x, None, positions, position_embeddings=rope)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = ours(x, rope, None, None)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("family", ["eagle", "eagle3", "dflash"])
def test_a_head_is_built_on_the_owned_modules_and_reads_and_writes_the_official_layout(family):
    """EAGLE-1/2, EAGLE-3 and DFlash heads are built on the owned decoder's modules in every regime (no
    transformers layer, attention, MLP or norm in them), their products joined (q/k/v, gate/up), yet their state dict
    is the checkpoint's: the same names and tensors as the bundled head's file, which loads back into a fresh head
    to the same outputs."""
    from specbench import methods  # noqa: F401 (registers the head families)
    from specbench.heads.checkpoint import read_weights
    from specbench.heads.folder import DFLASH_FILES, EAGLE_FILES
    from specbench.models.decoder import MLP, Attention
    from specbench.registry import HEADS

    target = load_causal_lm(TINY_DIR / "target", torch.device("cpu"), torch.float32, "target")
    head = HEADS[family].load(TINY_DIR / family, target).eval()
    kinds = {type(m).__module__.split(".")[0] for m in head.modules() if not type(m).__name__.endswith("Embedding")}
    assert "transformers" not in kinds
    assert any(isinstance(m, Attention) for m in head.modules()) == (family != "dflash")
    assert any(isinstance(m, MLP) and m.gate_up.out_features == 2 * m.down.in_features for m in head.modules())
    stored = read_weights(TINY_DIR / family, DFLASH_FILES if family == "dflash" else EAGLE_FILES, family)
    state = head.state_dict()
    assert any(".q_proj." in k for k in state) and not any(".qkv." in k or ".gate_up." in k for k in state)
    for name, tensor in stored.items():
        torch.testing.assert_close(state[name], tensor.to(state[name].dtype), rtol=0, atol=0)
    again = HEADS[family].load(TINY_DIR / family, target).eval()
    for module in again.modules():  # planted: a load that skipped the joined products would leave these
        if isinstance(module, MLP):
            torch.nn.init.zeros_(module.gate_up.weight)
    again.load_state_dict(state)
    torch.manual_seed(4)
    n = 6
    features = torch.randn(1, n, head.feature_size)
    tokens = torch.randint(0, target.config.vocab_size, (1, n))
    with torch.no_grad():
        if family == "dflash":
            block, positions = target.get_input_embeddings()(tokens), torch.arange(2 * n)[None]
            ours, theirs = (h(block, features, positions)[0] for h in (head, again))
        else:
            positions = torch.arange(3, 3 + n)[None]
            ours, theirs = (h(features, tokens, positions) for h in (head, again))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_a_target_outside_the_family_runs_graphs_eagerly_and_says_so(tmp_path, capsys):
    """The tiny target with a rope that changes with the length (dynamic): `--graphs` runs it on transformers, with
    one line on stderr, the reason in the manifest and a line in the report's Notes; its answers are vanilla's."""
    import json
    import shutil

    from specbench.cli.main import main

    target = tmp_path / "dynamic"
    shutil.copytree(TINY_DIR / "target", target)
    config = json.loads((target / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0}
    (target / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    args = [
        "run",
        "--model",
        str(target),
        "--methods",
        "vanilla,pld",
        "--limit",
        "1",
        "--tasks",
        "quick",
        "--max-new-tokens",
        "6",
        "--no-noise-floor",
        "--no-warmup",
        "--graphs",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "--graphs: the target runs eagerly on transformers, as its rope type 'dynamic' changes" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["graphs"]["decoder"] == "its rope type 'dynamic' changes with the sequence's length"
    report = (out / "report" / "report.md").read_text()
    assert "under --graphs the target ran eagerly on transformers, as its rope type 'dynamic'" in report


def _seen_by_hand(inputs, span: int) -> torch.Tensor:
    """Which keys each row of a batched forward sees, element by element: a real row its slot's cached rows and
    the new rows `local` marks (real ones only); a padding row column 0 alone."""
    batch, b = inputs.ids.shape
    seen = torch.zeros(batch, b, span, dtype=torch.bool)
    for s in range(batch):
        past, count = int(inputs.past[s]), int(inputs.count[s])
        for i, k in itertools.product(range(b), range(span)):
            if i >= count:
                seen[s, i, k] = k == 0
            else:
                seen[s, i, k] = k < past or (past <= k < past + count and bool(inputs.local[s, i, k - past]))
    return seen


@pytest.mark.parametrize("chained", [True, False])
def test_a_batched_forwards_mask_matches_one_built_by_hand(chained):
    """Inputs.built's mask, for chains (one comparison) and trees (the new rows scattered over the cache's), on
    random pasts, counts (padding rows, idle slots, an empty cache) and tree shapes."""
    generator = torch.Generator().manual_seed(0)
    span = 24
    for trial in range(24):
        batch, b = 1 + trial % 4, (1, 2, 4, 8)[trial % 4]
        inputs = Inputs.chain(batch, b, torch.device("cpu"))
        inputs.past.copy_(torch.randint(0, span - b + 1, (batch,), generator=generator))
        inputs.count.copy_(torch.randint(0, b + 1, (batch,), generator=generator))
        if not chained:  # each slot a random tree: a row sees its ancestors and itself
            for s in range(batch):
                parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, b)]
                for i in range(b):
                    inputs.local[s, i] = False
                    j = i
                    while j >= 0:
                        inputs.local[s, i, j], j = True, parents[j]
        mask, _, _ = inputs.built(span, torch.float32, chained)
        assert torch.equal(mask, additive(_seen_by_hand(inputs, span), torch.float32)[:, None])


@pytest.mark.parametrize("chunked", [1 << 30, 0])
def test_top_two_and_top1_are_argmax_and_the_top_k_margin_ties_included(monkeypatch, chunked):
    """Both ways (plain; by chunks of 64, forced at any size), on hand-worked rows and on random ones with many
    ties, vocabularies that are a multiple of the chunk and one that is not."""
    monkeypatch.setattr(cached_lm, "CHUNKED", chunked)
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, -1.0, 0.5, 1.5], [0.0, 0.0, 0.0, 0.0]])
    first, margin = top_two(logits)
    assert first.tolist() == top1(logits).tolist() == [1, 0, 0]
    assert margin.tolist() == [0.0, 0.5, 0.0]
    generator = torch.Generator().manual_seed(0)
    for vocab in (128, 192, 100):
        for trial in range(20):
            shape = (3, 2, vocab)
            x = (
                torch.randn(shape, generator=generator)
                if trial % 2
                else torch.randint(-2, 3, shape, generator=generator).float()
            )
            first, margin = top_two(x)
            top = x.topk(2, dim=-1).values
            assert torch.equal(first, x.argmax(-1)) and torch.equal(top1(x), x.argmax(-1))
            assert torch.equal(margin, top[..., 0] - top[..., 1])
