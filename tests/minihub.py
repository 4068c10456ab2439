"""A miniature Hugging Face hub cache: the aliases' repositories at their pinned commits, in the cache's real
layout (`models--org--name/{blobs,refs,snapshots/<commit>}`), holding scaled-down random models with the exact
file names, key names and formats of the published repositories."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from specbench import tasks
from specbench.heads import eagle as eagle_heads
from specbench.heads import eagle3 as eagle3_heads
from specbench.heads.medusa import MedusaHeads
from specbench.models.aliases import ALIASES
from specbench.models.hub import Source
from specbench.zoo.tokenizer import train_tokenizer

from .conftest import _small, random_llama


def _pickle(state: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _json(data: dict) -> bytes:
    return json.dumps(data, indent=2).encode()


def add_repo(hub: Path, source: Source, files: dict[str, bytes]) -> Path:
    """One repository at `source.revision`: blobs named by content hash, snapshot symlinks, refs/main."""
    root = hub / f"models--{source.id.replace('/', '--')}"
    snapshot = root / "snapshots" / source.revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "blobs").mkdir(exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(source.revision)
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(Path("../..") / "blobs" / blob.name if "/" not in name else blob)
    return snapshot


def _tokenizer_files(tokenizer, tmp: Path) -> dict[str, bytes]:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json, without a chat template (as Vicuna's)."""
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return {
        "tokenizer.json": (tmp / "tokenizer.json").read_bytes(),
        "tokenizer_config.json": _json(config),
        "special_tokens_map.json": _json(specials),
    }


def _llama_files(model, pickled_shards: bool) -> dict[str, bytes]:
    """config.json, generation_config.json and the weights: two pickled shards with an index (Vicuna's layout) or
    one model.safetensors (vicuna-68m's)."""
    config = model.config.to_dict()
    files = {
        "config.json": _json(config),
        "generation_config.json": _json({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}),
    }
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if not pickled_shards:
        files["model.safetensors"] = safetensors_bytes(state, metadata={"format": "pt"})
        return files
    keys = sorted(state)
    halves = (keys[: len(keys) // 2], keys[len(keys) // 2 :])
    names = [f"pytorch_model-{i:05d}-of-00002.bin" for i in (1, 2)]
    weight_map = {}
    for name, part in zip(names, halves, strict=True):
        files[name] = _pickle({k: state[k] for k in part})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(v.numel() * v.element_size() for v in state.values())
    files["pytorch_model.bin.index.json"] = _json({"metadata": {"total_size": total}, "weight_map": weight_map})
    return files


def _eagle_files(vocab: int, hidden: int, base: str) -> dict[str, bytes]:
    """EAGLE-1: config.json (EAGLE-Vicuna-7B-v1.3's key set) + pytorch_model.bin with embed_tokens and fc.bias."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": 2 * hidden,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": vocab,
    }
    torch.manual_seed(3)
    state = eagle_heads.build(config).state_dict()
    return {"config.json": _json(config), "pytorch_model.bin": _pickle(state), "README.md": f"head for {base}".encode()}


def _eagle3_config(vocab: int, hidden: int, **changes) -> dict:
    """EAGLE3-Vicuna1.3-13B's config.json key set at `hidden` wide, the full vocabulary drafted; `changes` on top."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": 2 * hidden,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": vocab,
        "draft_vocab_size": vocab,
        **changes,
    }


def _eagle3_files(vocab: int, hidden: int) -> dict[str, bytes]:
    """EAGLE-3 (EAGLE3-Vicuna1.3-13B): the full vocabulary as draft vocabulary, d2t zeros and t2d all true,
    no embed_tokens (the target's), in pytorch_model.bin."""
    config = _eagle3_config(vocab, hidden)
    torch.manual_seed(4)
    state = {k: v for k, v in eagle3_heads.build(config).state_dict().items() if k != "embed_tokens.weight"}
    state["d2t"] = torch.zeros(vocab, dtype=torch.long)
    state["t2d"] = torch.ones(vocab, dtype=torch.bool)
    return {"config.json": _json(config), "pytorch_model.bin": _pickle(state)}


def _medusa_files(vocab: int, hidden: int, base: str) -> dict[str, bytes]:
    """medusa_lm_head.pt (a pickled ModuleList state dict, 5 heads) + the config that says 2 heads."""
    torch.manual_seed(5)
    heads = MedusaHeads(5, 1, hidden, vocab)
    config = {
        "base_model_name_or_path": base,
        "medusa_num_heads": 2,
        "medusa_num_layers": 1,
        "transformers_version": "4.31.0",
    }
    return {"config.json": _json(config), "medusa_lm_head.pt": _pickle(heads.state_dict())}


def build(hub: Path, work: Path, aliases: tuple[str, ...] = ("vicuna-7b", "vicuna-13b")) -> None:
    """Every checkpoint of `aliases` into the hub cache folder `hub`, at the alias's pinned commit."""
    text = [turn for q in tasks.load("quick").questions for turn in q.turns]
    tokenizer = train_tokenizer(text * 3, vocab_size=400)
    tok_files = _tokenizer_files(tokenizer, work / "tokenizer")
    vocab = len(tokenizer)
    done: set[str] = set()
    for n, alias in enumerate(aliases):
        spec = ALIASES[alias]
        hidden = 64 + 16 * n  # each alias its own width, so a head of one does not fit the other
        target = random_llama(vocab, layers=5, hidden=hidden, seed=n, init=0.1)  # EAGLE-3 reads layers 2, 2, 2
        add_repo(hub, spec.target, {**_llama_files(target, pickled_shards=True), **tok_files})
        if spec.draft and spec.draft.id not in done:
            draft = random_llama(vocab, layers=1, hidden=32, seed=10, init=0.1)
            add_repo(hub, spec.draft, {**_llama_files(draft, pickled_shards=False), **tok_files})
            done.add(spec.draft.id)
        for family, source in spec.heads.items():
            if family == "eagle":
                files = _eagle_files(vocab, hidden, spec.target.id)
            elif family == "eagle3":
                files = _eagle3_files(vocab, hidden)
            else:
                files = _medusa_files(vocab, hidden, spec.target.id)
            add_repo(hub, source, files)


# ---------------------------------------------------------------- the 2026 aliases (Llama-3.1 and Qwen3)

# Qwen3's chat template, cut to what a prompt needs: turns in ChatML and the switch that turns thinking off
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
QWEN3_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]  # the mask: DFlash's and PARD's


def commit_of(source: Source) -> str:
    """The commit a repository sits at in the miniature cache: the alias's pin, else one made from its id."""
    return source.revision or hashlib.sha1(source.id.encode()).hexdigest()


def _at_commit(source: Source) -> Source:
    return Source(source.id, commit_of(source))


def _qwen3_tokenizer(work: Path) -> tuple[dict[str, bytes], int, int]:
    """(tokenizer files with Qwen3's specials and template, vocabulary, mask token id)."""
    text = [turn for q in tasks.load("quick").questions for turn in q.turns]
    tokenizer = train_tokenizer(text * 3, vocab_size=400)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN3_SPECIALS, "eos_token": "<|im_end|>"})
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(work)
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
    files = {n: (work / n).read_bytes() for n in names if (work / n).is_file()}
    return files, len(tokenizer), tokenizer.convert_tokens_to_ids("<|mask|>")


def _qwen3(vocab: int, hidden: int, layers: int, tied: bool, seed: int, **extra) -> dict[str, bytes]:
    """A Qwen3 checkpoint (Qwen/Qwen3-8B's config keys, scaled down) in one model.safetensors."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        attention_bias=False,
        bos_token_id=vocab - len(QWEN3_SPECIALS),
        eos_token_id=vocab - len(QWEN3_SPECIALS) + 1,
        head_dim=16,
        hidden_act="silu",
        hidden_size=hidden,
        initializer_range=0.1,
        intermediate_size=2 * hidden,
        max_position_embeddings=40960,
        max_window_layers=layers,
        num_attention_heads=4,
        num_hidden_layers=layers,
        num_key_value_heads=2,
        rms_norm_eps=1e-06,
        rope_theta=1000000,
        sliding_window=None,
        tie_word_embeddings=tied,
        use_sliding_window=False,
        vocab_size=vocab,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": [config.eos_token_id], "do_sample": True}
    return {
        "config.json": _json({**config.to_dict(), **extra}),
        "generation_config.json": _json(generation),
        "model.safetensors": safetensors_bytes(state, metadata={"format": "pt"}),
    }


def _llama31(vocab: int, hidden: int, layers: int, tied: bool, factor: float, seed: int) -> dict[str, bytes]:
    """A Llama-3.1/3.2 checkpoint (their config keys: llama3 RoPE scaling, three stop ids), scaled down."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(
        **{**_small(vocab, layers, hidden, 131072, 0.1), "tie_word_embeddings": tied},
        rms_norm_eps=1e-05,
        rope_theta=500000.0,
        rope_scaling={**rope, "rope_type": "llama3"},
        bos_token_id=1,
        eos_token_id=[2],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    return {
        "config.json": _json({**config.to_dict(), "architectures": ["LlamaForCausalLM"]}),
        "generation_config.json": _json({"bos_token_id": 1, "eos_token_id": [2], "temperature": 0.6, "top_p": 0.9}),
        "model.safetensors": safetensors_bytes(state, metadata={"format": "pt"}),
    }


def _eagle3_head(vocab: int, hidden: int, rope_theta: float, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """An EAGLE-3 head's official config (LlamaForCausalLMEagle3, a reduced draft vocabulary) and tensors."""
    config = _eagle3_config(
        vocab,
        hidden,
        architectures=["LlamaForCausalLMEagle3"],
        num_key_value_heads=2,
        rms_norm_eps=1e-05,
        rope_theta=rope_theta,
        draft_vocab_size=vocab // 2,
    )
    torch.manual_seed(seed)
    head = eagle3_heads.build(config)
    head.d2t, head.t2d = eagle3_heads.vocabulary_maps(torch.arange(0, vocab, 2)[: vocab // 2], vocab)
    return config, eagle3_heads.saved_state(head)


def _eagle3_published(kind: str, vocab: int, hidden: int, rope_theta: float, seed: int, target: dict) -> dict:
    """An EAGLE-3 head as its publisher lays it out: "eagle" (yuhuili, AngelSlim: pytorch_model.bin), "specforge"
    (model.safetensors, no embedding) or "speculators" (RedHatAI)."""
    from specbench.heads import speculators

    config, state = _eagle3_head(vocab, hidden, rope_theta, seed)
    if kind == "eagle":
        return {"config.json": _json(config), "pytorch_model.bin": _pickle(state)}
    if kind == "specforge":
        return {"config.json": _json(config), "model.safetensors": safetensors_bytes(state)}
    written = Path(target["work"]) / f"speculators-{seed}"
    verifier = {"name_or_path": target["id"], "architectures": target["architectures"]}
    speculators.save_eagle3(
        state, {**config, "norm_before_residual": target["norm_before_residual"]}, written, verifier, None
    )
    return {n: (written / n).read_bytes() for n in ("config.json", "model.safetensors")}


def _dflash_files(target_files: dict[str, bytes], mask: int, seed: int) -> dict[str, bytes]:
    """A z-lab DFlash drafter for the target (DFlashDraftModel, 2 layers, blocks of 16) in model.safetensors."""
    from transformers import AutoConfig

    from specbench.heads import dflash

    raw = json.loads(target_files["config.json"])
    target_config = AutoConfig.for_model(**raw)
    config = dflash.config_for(target_config, layers=2, block_size=16, mask_token_id=mask)
    config["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    config["layer_types"] = ["full_attention"] * 2
    torch.manual_seed(seed)
    state = {k: v.contiguous() for k, v in dflash.saved_state(dflash.build(config)).items()}
    return {"config.json": _json(config), "model.safetensors": safetensors_bytes(state)}


def _glm_files(vocab: int, work: Path) -> dict[str, bytes]:
    """GLM-4.7-Flash scaled down (its config keys: MLA, MoE after one dense layer, one MTP layer), its MTP module in a
    shard of its own at model.layers.{N}.* (routed experts one by one): the target's last layer reading the next
    token's embedding and the target's readout, so a random target accepts some of its drafts."""
    from safetensors.torch import save_file
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    from .test_mtp import DEEPSEEK, published

    hidden, layers = DEEPSEEK["hidden_size"], 3
    config = Glm4MoeLiteConfig(**{**DEEPSEEK, "vocab_size": vocab}, num_hidden_layers=layers)
    torch.manual_seed(27)
    model = Glm4MoeLiteForCausalLM(config).eval()
    folder = work / "glm"
    model.save_pretrained(folder)
    own = {
        "enorm.weight": torch.ones(hidden),
        "hnorm.weight": torch.ones(hidden),
        "eh_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1),
        "shared_head.norm.weight": model.model.norm.weight.detach(),
        "shared_head.head.weight": model.lm_head.weight.detach(),
    }
    stored = {
        f"model.layers.{layers}.{k}": v.contiguous() for k, v in {**published(model.model.layers[-1]), **own}.items()
    }
    save_file(stored, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in model.state_dict()}
    weight_map.update(dict.fromkeys(stored, "model-00002-of-00002.safetensors"))
    raw = {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if k != "mlp_layer_types"}
    files = {p.name: p.read_bytes() for p in folder.glob("*.safetensors")}
    files["model.safetensors.index.json"] = _json({"metadata": {}, "weight_map": weight_map})
    files["config.json"] = _json({**raw, "num_nextn_predict_layers": 1, "first_k_dense_replace": 1})
    return files


def _pard2(files: dict[str, bytes], mask: int, target_hidden: int, seed: int) -> dict[str, bytes]:
    """A causal LM's files made a PARD-2 drafter (AMD-AGI/PARD `pard2_train.py`'s converter: config.json's pard_token
    and pard2_* keys, warp_model.bin with target_proj) reading four states of a 6-layer target (the official
    [-1, -8, -16, -24] of 36 layers, scaled down)."""
    import io

    layers = [-1, -2, -4, -6]
    config = json.loads(files["config.json"])
    config.update(
        pard_token=mask,
        pard2=True,
        spd_type="pard2",
        pard2_scale=0.02,
        pard2_proj_bias=False,
        pard2_target_dim=target_hidden * len(layers),
        pard2_target_layers=layers,
    )
    torch.manual_seed(seed)
    warp = io.BytesIO()
    torch.save({"target_proj.weight": torch.randn(config["hidden_size"], target_hidden * len(layers)) * 0.1}, warp)
    return {**files, "config.json": _json(config), "warp_model.bin": warp.getvalue()}


def _dspark_files(target_files: dict[str, bytes], mask: int, seed: int, markov: bool) -> dict[str, bytes]:
    """A DeepSpec drafter for the target (`qwen3/config.py` build_draft_config's keys: the target's config plus
    block_size 7, mask_token_id, target_layer_ids, markov_*, the confidence head's flags; 2 layers), its embedding
    and readout stored as the released ones do. `markov`: DSpark; else the matched DFlash (markov_rank 0, no
    confidence head: `config/dflash/*.py`)."""
    from transformers import AutoConfig

    from specbench.heads import dflash, dspark

    raw = json.loads(target_files["config.json"])
    settings = dflash.config_for(AutoConfig.for_model(**raw), 2, 7, mask)["dflash_config"]
    config = {
        **raw,
        "architectures": ["Qwen3DSparkModel"],
        "num_hidden_layers": 2,
        "layer_types": ["full_attention"] * 2,
        "num_target_layers": raw["num_hidden_layers"],
        "block_size": 7,
        "mask_token_id": mask,
        "target_layer_ids": settings["target_layer_ids"],
        "num_anchors": 512,
        "markov_rank": 16 if markov else 0,
        "markov_head_type": "vanilla",
        "enable_confidence_head": markov,
        "confidence_head_with_markov": markov,
    }
    torch.manual_seed(seed)
    state = {k: v.contiguous() for k, v in dspark.saved_state(dspark.build(config)).items()}
    return {"config.json": _json(config), "model.safetensors": safetensors_bytes(state)}


def _deepspec_eagle3(target_files: dict[str, bytes], seed: int) -> dict[str, bytes]:
    """A DeepSpec EAGLE-3 head for the target (`Qwen3Eagle3Model`: `eagle3/qwen3/config.py` build_draft_config's
    keys over the target's config, five fused layers, one draft layer stored as `layers.0.`, the whole vocabulary)."""
    from specbench.heads import deepspec, eagle3

    raw = json.loads(target_files["config.json"])
    config = {
        **raw,
        "architectures": ["Qwen3Eagle3Model"],
        "num_hidden_layers": 1,
        "layer_types": ["full_attention"],
        "num_target_layers": raw["num_hidden_layers"],
        "target_layer_ids": list(range(5)),
        "ttt_length": 7,
        "step_loss_decay": 0.8,
        "draft_num_hidden_layers": 1,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(seed)
    head = eagle3.build(deepspec.eagle3_official(config, "DeepSpec head"))
    state = {k.replace("midlayer.", "layers.0.", 1): v.contiguous() for k, v in head.state_dict().items()}
    return {"config.json": _json(config), "model.safetensors": safetensors_bytes(state)}


def _peagle_speculators(vocab: int, hidden: int, rope_theta: float, mask: int, seed: int, target: dict) -> dict:
    """A P-EAGLE head in speculators' `peagle` layout (RedHatAI's), written as `convert` writes one."""
    from specbench.heads import peagle, speculators

    config, _ = _eagle3_head(vocab, hidden, rope_theta, seed)
    config["mask_token_id"] = mask
    head = peagle.build(config)
    head.d2t, head.t2d = eagle3_heads.vocabulary_maps(torch.arange(0, vocab, 2)[: vocab // 2], vocab)
    verifier = {"name_or_path": target["id"], "architectures": target["architectures"]}
    written = Path(target["work"]) / f"peagle-{seed}"
    state = speculators.eagle3_speculators_state(eagle3_heads.saved_state(head))
    speculators.write(speculators.eagle3_speculators(config, verifier, None, "peagle"), state, written)
    return {n: (written / n).read_bytes() for n in ("config.json", "model.safetensors")}


def build_2026(hub: Path, work: Path) -> None:
    """The llama3.1-8b, qwen3-8b, qwen3-4b and glm4.7-flash aliases with every head, scaled down, into the hub
    cache `hub` (an unpinned repository at a commit made from its id: `commit_of`)."""
    qwen_tok, qwen_vocab, mask = _qwen3_tokenizer(work / "qwen3-tokenizer")
    text = [turn for q in tasks.load("quick").questions for turn in q.turns]
    llama_tok = _tokenizer_files(train_tokenizer(text * 3, vocab_size=400), work / "llama-tokenizer")
    llama_vocab = 400
    glm = ALIASES["glm4.7-flash"].target
    add_repo(hub, _at_commit(glm), {**_glm_files(llama_vocab, work), **llama_tok})
    specs = {name: ALIASES[name] for name in ("llama3.1-8b", "qwen3-8b", "qwen3-4b")}
    targets = {
        "llama3.1-8b": _llama31(llama_vocab, 80, 6, tied=False, factor=8.0, seed=20),
        "qwen3-8b": _qwen3(qwen_vocab, 64, 6, tied=False, seed=21),
        "qwen3-4b": _qwen3(qwen_vocab, 48, 6, tied=True, seed=22),
    }
    hidden = {"llama3.1-8b": 80, "qwen3-8b": 64, "qwen3-4b": 48}
    llama = specs["llama3.1-8b"]
    add_repo(hub, _at_commit(llama.draft), {**_llama31(llama_vocab, 32, 1, True, 32.0, 23), **llama_tok})
    qwen_draft = specs["qwen3-8b"].draft
    add_repo(hub, _at_commit(qwen_draft), {**_qwen3(qwen_vocab, 32, 1, tied=True, seed=24), **qwen_tok})
    pard = _qwen3(qwen_vocab, 32, 2, tied=True, seed=25, pard_token=mask, spd_type="pard")
    add_repo(hub, _at_commit(specs["qwen3-8b"].heads["pard"]), {**pard, **qwen_tok})
    llama_pard = _llama31(llama_vocab, 32, 2, True, 32.0, 26)
    config = json.loads(llama_pard["config.json"])
    llama_pard["config.json"] = _json({**config, "pard_token": 3, "spd_type": "pard"})
    add_repo(hub, _at_commit(llama.heads["pard"]), {**llama_pard, **llama_tok})
    qwen_pard2 = _qwen3(qwen_vocab, 32, 2, tied=True, seed=27)
    add_repo(hub, _at_commit(specs["qwen3-8b"].heads["pard2"]), {**_pard2(qwen_pard2, mask, 64, 28), **qwen_tok})
    llama_pard2 = _llama31(llama_vocab, 32, 2, True, 32.0, 29)
    add_repo(hub, _at_commit(llama.heads["pard2"]), {**_pard2(llama_pard2, 3, 80, 30), **llama_tok})
    for n, (name, spec) in enumerate(specs.items()):
        tok = llama_tok if name == "llama3.1-8b" else qwen_tok
        add_repo(hub, _at_commit(spec.target), {**targets[name], **tok})
        raw = json.loads(targets[name]["config.json"])
        vocab, theta = raw["vocab_size"], raw.get("rope_theta") or raw["rope_parameters"]["rope_theta"]
        target = {
            "id": spec.target.id,
            "architectures": raw["architectures"],
            "norm_before_residual": name.startswith("qwen3"),  # RedHatAI's Qwen3 head: true
            "work": work,
        }
        for key, source in spec.heads.items():
            if key in ("pard", "pard2"):  # (the drafters above, one per vocabulary)
                continue
            if key == "dflash":
                files = _dflash_files(targets[name], mask if tok is qwen_tok else 3, 30 + n)
            elif key.startswith("dspark"):
                files = _dspark_files(targets[name], mask, 50 + n, markov=key == "dspark")
            elif key == "eagle3:deepspec":
                files = _deepspec_eagle3(targets[name], 70 + n)
            elif key == "peagle":
                files = _peagle_speculators(vocab, hidden[name], theta, mask, 60 + n, target)
            else:
                kind = {"eagle3:redhat": "speculators", "eagle3:specforge": "specforge"}.get(key, "eagle")
                files = _eagle3_published(kind, vocab, hidden[name], theta, 40 + n, target)
            add_repo(hub, _at_commit(source), files)
