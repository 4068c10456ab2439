"""Model aliases (one place) and loading of targets, drafts and tokenizers from a path or the hub."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import SpecbenchError
from .zoo import TINY_DIR


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str  # hub id or local folder of the target
    draft: str | None = None  # small model for sps / ouroboros, same tokenizer
    heads: dict[str, str] = field(default_factory=dict)  # method family -> checkpoint (medusa, eagle, eagle3)
    note: str = ""


def _vicuna(size: str, eagle3: str | None = None) -> ModelSpec:
    return ModelSpec(
        name=f"vicuna-{size.lower()}",
        path=f"lmsys/vicuna-{size.lower()}-v1.3",
        draft="double7/vicuna-68m",
        heads={
            "medusa": f"FasterDecoding/medusa-vicuna-{size.lower()}-v1.3",
            "eagle": f"yuhuili/EAGLE-Vicuna-{size.upper()}-v1.3",
            **({"eagle3": eagle3} if eagle3 else {}),
        },
        note="Vicuna v1.3 (LMSYS); SpS draft from MCSD",
    )


ALIASES: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        name="tiny",
        path=str(TINY_DIR / "target"),
        draft=str(TINY_DIR / "draft"),
        heads={family: str(TINY_DIR / family) for family in ("medusa", "eagle", "eagle3")},
        note="bundled tiny Llama family, trained by `specbench zoo build`",
    ),
    **{spec.name: spec for spec in (_vicuna("7B"), _vicuna("13B", "yuhuili/EAGLE3-Vicuna1.3-13B"), _vicuna("33B"))},
    "llama3.1-8b": ModelSpec(
        name="llama3.1-8b",
        path="meta-llama/Llama-3.1-8B-Instruct",
        heads={"eagle3": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"},
        note="Llama 3.1 8B Instruct (gated on the hub); EAGLE-3 head only",
    ),
}


def resolve(name: str) -> ModelSpec:
    """An alias, a local folder, or a hub id ("org/name")."""
    if name in ALIASES:
        return ALIASES[name]
    if Path(name).expanduser().is_dir():
        return ModelSpec(name=Path(name).name, path=str(Path(name).expanduser()))
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return ModelSpec(name=name.split("/")[1], path=name)
    raise SpecbenchError(
        f"unknown model '{name}': use an alias ({', '.join(ALIASES)}), a local folder or a hub id like org/name"
    )


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise SpecbenchError(f"bad --device '{device}': use auto, cpu, cuda or cuda:N") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecbenchError(f"--device {device} asked for, but no CUDA device is available: use --device cpu")
    return dev


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise SpecbenchError(f"bad --dtype '{dtype}': use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _check_local(path: str, what: str) -> None:
    if path.startswith(str(TINY_DIR)) and not Path(path).is_dir():
        raise SpecbenchError(f"the bundled tiny {what} is missing at {path}: build it with `specbench zoo build`")


def load_causal_lm(path: str, device: torch.device, dtype: torch.dtype, what: str = "model"):
    from transformers import AutoModelForCausalLM

    _check_local(path, what)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as err:
        raise SpecbenchError(f"could not load {what} '{path}': {str(err).splitlines()[0]}") from err
    return model.to(device).eval()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    _check_local(path, "tokenizer")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise SpecbenchError(f"could not load the tokenizer of '{path}': {str(err).splitlines()[0]}") from err


def same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id


def stop_ids(tokenizer, model) -> set[int]:
    """Token ids that end a turn: the tokenizer's EOS and the model's generation-config EOS ids."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    return ids
