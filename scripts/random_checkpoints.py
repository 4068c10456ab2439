"""Random-weight checkpoints at a real model's shapes, in the official layouts (target, draft, EAGLE-1/2, EAGLE-3,
Medusa, MTP, DFlash, PARD), over the bundled tokenizer: the loop's costs at a 7B's size with nothing downloaded.
Random heads accept almost nothing (τ ≈ 1), so these time forwards and the loop, never a method's speedup.

    python scripts/random_checkpoints.py --like vicuna-7b --out DIR [--device cuda] [--dtype float16]

prints the `specbench run` options that use them (`--model DIR/target --draft ... --head eagle=...`)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specbench.errors import SpecbenchError
from specbench.heads import dflash, eagle, eagle3, medusa, mtp
from specbench.models.aliases import TINY_DIR
from specbench.models.loading import device_and_dtype

# Each model's config.json as published (the shapes only); a draft where the alias has one (vicuna-68m).
_LOOP = dict(  # one layer, 64 wide: a forward nearly free, for the loop's own cost (scripts/loop_overhead.py)
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=512,  # (ids past it never occur: the overhead script's prompts are random ids below it)
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
)
SHAPES: dict[str, dict[str, dict | None]] = {
    "loop": {"target": _LOOP, "draft": _LOOP},
    "vicuna-7b": {
        "target": dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
        ),
        "draft": dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=2,
            num_attention_heads=12,
            num_key_value_heads=12,
            vocab_size=32000,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
        ),
    },
    "llama3.1-8b": {
        "target": dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        "draft": None,
    },
}
MEDUSA_HEADS = 5  # as the official Medusa-1 checkpoints
EAGLE3_DRAFT_VOCAB = 32000  # as the official EAGLE-3 heads
DFLASH_LAYERS = 5  # as z-lab's drafters for 8B targets


def _config(shape: dict, tokenizer_dir: Path) -> LlamaConfig:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return LlamaConfig(
        **shape,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _model(config: LlamaConfig, device: torch.device, dtype: torch.dtype, out: Path) -> LlamaForCausalLM:
    """A random model written as a Hugging Face folder with the bundled tokenizer (ids below every vocabulary)."""
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (TINY_DIR / "target" / name).is_file():
            shutil.copy(TINY_DIR / "target" / name, out / name)
    return model


@torch.no_grad()
def write_random(
    like: str, out: Path, device: torch.device, dtype: torch.dtype = torch.float16, seed: int = 0
) -> dict[str, Path]:
    """Every checkpoint of `like`'s shapes under `out` (target/, draft/, eagle/, eagle3/, medusa/, mtp/, dflash/,
    pard/); returns role -> folder. Heads are stored in float16, as published; the PARD drafter has the draft's
    shapes."""
    if like not in SHAPES:
        raise SpecbenchError(f"no shapes for '{like}': use one of {', '.join(SHAPES)}")
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    shapes = SHAPES[like]
    config = _config(shapes["target"], TINY_DIR / "target")
    folders = {"target": out / "target"}
    target = _model(config, device, dtype, folders["target"])
    if shapes["draft"]:
        folders["draft"] = out / "draft"
        _model(_config(shapes["draft"], TINY_DIR / "target"), device, dtype, folders["draft"])
    raw = eagle.config_from_target(target.config)
    with torch.device(device):
        head = eagle.build(raw)
    folders["eagle"] = out / "eagle"
    eagle.save(head.state_dict(), raw, folders["eagle"], half=True)  # embedding included, as the Vicuna heads
    vocab = config.vocab_size
    raw3 = {**raw, "draft_vocab_size": min(EAGLE3_DRAFT_VOCAB, vocab)}
    layers = config.num_hidden_layers
    if layers < 5:  # (too shallow for the default states 2, L//2, L-3: the head names its own)
        raw3["eagle_aux_hidden_state_layer_ids"] = [0, layers // 2, layers]
    with torch.device(device):
        head3 = eagle3.build(raw3)
    if head3.d2t is not None:
        head3.d2t, head3.t2d = eagle3.vocabulary_maps(torch.arange(raw3["draft_vocab_size"], device=device), vocab)
    folders["eagle3"] = out / "eagle3"
    eagle3.save(head3, raw3, folders["eagle3"], half=True)
    with torch.device(device):
        heads = medusa.MedusaHeads(MEDUSA_HEADS, 1, config.hidden_size, vocab)
    folders["medusa"] = out / "medusa"
    medusa.save(heads, folders["medusa"], f"random {like}", half=True)
    with torch.device(device):
        module = mtp.MtpHead(target, mtp.DEEPSEEK)
    folders["mtp"] = out / "mtp"
    mtp.save(module, target.config, folders["mtp"], half=True, with_shared=False)
    raw_dflash = dflash.config_for(target.config, DFLASH_LAYERS, 16, mask_token_id=vocab - 1)  # the released shape
    with torch.device(device):
        drafter = dflash.build(raw_dflash)
    folders["dflash"] = out / "dflash"
    dflash.save(drafter, raw_dflash, folders["dflash"], half=True)
    if shapes["draft"]:  # the draft's shapes, made a PARD drafter by its config key
        folders["pard"] = out / "pard"
        shutil.copytree(folders["draft"], folders["pard"])
        path = folders["pard"] / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "pard_token": vocab - 1, "spd_type": "pard"}))
    return folders


def run_options(folders: dict[str, Path]) -> str:
    """The `specbench run` options that load these checkpoints."""
    heads = " ".join(f"--head {role}={path}" for role, path in folders.items() if role not in ("target", "draft"))
    draft = f" --draft {folders['draft']}" if "draft" in folders else ""
    return f"--model {folders['target']}{draft} {heads}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", default="vicuna-7b", choices=list(SHAPES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="the target's and draft's; heads are float16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        device, dtype = device_and_dtype(args.device, args.dtype)
        print(run_options(write_random(args.like, args.out, device, dtype, args.seed)))
    except SpecbenchError as err:
        print(f"random_checkpoints: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
