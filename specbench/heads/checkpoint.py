"""Reading a head checkpoint's weights and checking them against a module (its folder and config.json:
`folder`, read without torch)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ..errors import SpecbenchError
from .folder import first


def _unreadable(err: Exception, source: str | Path, path: Path, what: str) -> SpecbenchError:
    """Any unreadable weights file: corrupt, truncated, not a state dict, or a pickle with code in it."""
    return SpecbenchError(f"{what} '{source}': cannot read {path.name} ({str(err).splitlines()[0]})")


def read_weights(source: str | Path, names: tuple[str, ...], what: str) -> dict[str, torch.Tensor]:
    """The first of `names` that exists: safetensors, or a pickle read with weights_only=True."""
    path = first(source, names, what)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise _unreadable(err, source, path, what) from err


def weight_shapes(source: str | Path, names: tuple[str, ...], what: str) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the first of `names` that exists, without reading the tensors (header or mmap)."""
    path = first(source, names, what)
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        return {k: tuple(v.shape) for k, v in torch.load(path, weights_only=True, mmap=True).items()}
    except Exception as err:
        raise _unreadable(err, source, path, what) from err


def check(expected: dict[str, torch.Size], state: dict[str, torch.Tensor], what: str) -> None:
    """Exact key set and shapes, or an error naming the first offending key."""
    for key, shape in expected.items():
        if key not in state:
            raise SpecbenchError(f"{what}: key '{key}' is missing from the checkpoint")
        if state[key].shape != shape:
            raise SpecbenchError(f"{what}: key '{key}' has shape {list(state[key].shape)}, expected {list(shape)}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise SpecbenchError(f"{what}: unexpected key '{extra[0]}' in the checkpoint ({len(extra)} unexpected)")


def save_safetensors(state: dict[str, torch.Tensor], path: Path, half: bool = False) -> None:
    """`half`: floating-point tensors stored as float16 (half the size; heads are cast to the run's dtype on load)."""
    from safetensors.torch import save_file

    def stored(v: torch.Tensor) -> torch.Tensor:
        return v.half() if half and v.is_floating_point() else v

    save_file({k: stored(v.detach()).contiguous().cpu() for k, v in state.items()}, str(path))


def target_signature(model: Any) -> str | None:
    """A hash of the target's input embedding rounded to float16, or None for a bfloat16 model.

    A head trained by `specbench train` records it, so loading the head with a retrained target can be
    caught. The float16 rounding makes the hash the same for a float32 or float16 load of a checkpoint
    stored in either; bfloat16 loses bits that the hash would see, so it is not compared.
    """
    weight = model.get_input_embeddings().weight
    if weight.dtype == torch.bfloat16:
        return None
    return hashlib.sha256(weight.detach().to("cpu", torch.float16).numpy().tobytes()).hexdigest()[:16]


def trained_for_other_target(source: str, model: torch.nn.Module) -> bool:
    """Whether a local head's accuracy.json records a different target signature than `model`'s."""
    report = Path(source).expanduser() / "accuracy.json"
    if not report.is_file():
        return False
    try:
        recorded = json.loads(report.read_text()).get("target_signature")
    except (OSError, ValueError):
        return False
    current = target_signature(model)
    return recorded is not None and current is not None and recorded != current


def read_prefixed(source: str | Path, prefix: str, what: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` (keys with it removed) in a folder's safetensors, sharded or not: with a
    model.safetensors.index.json only the shards holding such keys are opened (one layer of a 600B model)."""
    from safetensors import safe_open

    folder = Path(source).expanduser()
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted({file for key, file in weight_map.items() if key.startswith(prefix)})
        else:
            names = sorted(p.name for p in folder.glob("*.safetensors"))
    except (OSError, ValueError, KeyError) as err:
        raise SpecbenchError(f"{what}: unreadable {index.name} ({err})") from err
    out = {}
    for name in names:
        try:
            with safe_open(str(folder / name), "pt") as f:
                for key in f.keys():  # noqa: SIM118
                    if key.startswith(prefix):
                        out[key[len(prefix) :]] = f.get_tensor(key)
        except Exception as err:
            raise _unreadable(err, source, folder / name, what) from err
    if not out:
        raise SpecbenchError(f"{what}: no weights under '{prefix}' in {', '.join(names) or 'its safetensors files'}")
    return out
