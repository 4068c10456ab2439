"""A head checkpoint's folder, known without torch: the files each family's checkpoint holds (the layout
`hub.checkpoint` lists it against) and its config.json. The loaders read a folder through these, and a command
judges the folders it is given through the same ones before its heavy imports."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecbenchError
from ..models.hub import TRANSFORMERS, Layout

EAGLE_FILES = ("pytorch_model.bin", "model.safetensors")  # EAGLE-1/2 and EAGLE-3 heads
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
DFLASH_FILES = ("model.safetensors",)
_CONFIG = ("config.json",)
_EAGLE = Layout(tuple((f,) for f in EAGLE_FILES), required=_CONFIG)
HEAD_LAYOUTS = {  # family -> its checkpoint's files: the family's `HeadFamily.layout`
    "medusa": Layout(tuple((f,) for f in MEDUSA_FILES)),  # config.json optional: the weights say how many heads
    "eagle": _EAGLE,
    "eagle3": _EAGLE,
    "peagle": _EAGLE,
    "mtp": Layout((("model*.safetensors",),), ("config.json", "model.safetensors.index.json"), _CONFIG),
    "dflash": Layout((DFLASH_FILES,), required=_CONFIG),
    "dflash2": Layout((DFLASH_FILES,), required=_CONFIG),
    "dspark": Layout((DFLASH_FILES,), required=_CONFIG),
    "pard": TRANSFORMERS,
    "pard2": Layout(TRANSFORMERS.weights[:1], TRANSFORMERS.optional, ("config.json", "warp_model.bin")),
}


def fetch(source: str | Path, name: str) -> Path | None:
    """`name` inside the head folder `source` (hub heads are fetched into the local cache first), or None."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise SpecbenchError(f"head checkpoint '{source}' is not a folder")
    return folder / name if (folder / name).is_file() else None


def first(source: str | Path, names: tuple[str, ...], what: str) -> Path:
    """The first of `names` present in the head folder (its weights file)."""
    path = next((p for p in (fetch(source, n) for n in names) if p is not None), None)
    if path is None:
        raise SpecbenchError(f"{what} '{source}' has none of {', '.join(names)}")
    return path


def read_config(source: str | Path, what: str) -> dict:
    """The head's config.json, a JSON object; a missing or unreadable one is one line."""
    path = fetch(source, "config.json")
    if path is None:
        raise SpecbenchError(f"{what} '{source}' has no config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SpecbenchError(f"{what} '{source}': unreadable config.json ({err})") from err
    if not isinstance(config, dict):
        raise SpecbenchError(f"{what} '{source}': config.json is not a JSON object")
    return config


def config_shape(source: str | Path, what: str, hidden_keys: tuple[str, ...]) -> tuple[int, int | None]:
    """(target hidden size, vocabulary) a head's config.json says it was built for: the first of `hidden_keys`."""
    config = read_config(source, what)
    hidden = next((config[k] for k in hidden_keys if config.get(k)), None)
    if not isinstance(hidden, int):
        raise SpecbenchError(f"{what} '{source}': config.json has no {' or '.join(hidden_keys)}")
    return hidden, config.get("vocab_size")
