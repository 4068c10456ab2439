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

from .conftest import random_llama


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


def _eagle3_files(vocab: int, hidden: int) -> dict[str, bytes]:
    """EAGLE-3 (EAGLE3-Vicuna1.3-13B): the full vocabulary as draft vocabulary, d2t zeros and t2d all true,
    no embed_tokens (the target's), in pytorch_model.bin."""
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
    }
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
