"""A head folder converted between its official layout and vLLM's speculators format (EAGLE-3 heads, DFlash
drafters): which family a folder holds, the translation (`speculators`), its other files copied beside, and
nothing half-written at the destination."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import SpecbenchError
from . import eagle, speculators
from .checkpoint import read_config, read_weights
from .eagle3 import feature_layers

LAYOUTS = ("speculators", "official")


def family_of(raw: dict, what: str) -> str:
    """ "eagle3" or "dflash", from a config.json in either layout; any other head is one error line."""
    kind = raw.get("speculators_model_type")
    if kind in ("eagle3", "dflash"):
        return kind
    if kind is None and "draft_vocab_size" in raw:
        return "eagle3"
    if kind is None and "DFlashDraftModel" in (raw.get("architectures") or []):
        return "dflash"
    found = f"a speculators '{kind}' checkpoint" if kind else "neither an EAGLE-3 head nor a DFlash drafter"
    raise SpecbenchError(f"{what} is {found}: only EAGLE-3 heads and DFlash drafters convert")


def convert(source: Path, to: str, out: Path, target: str | None = None) -> str:
    """Convert the head folder `source` to the layout `to` in `out`; returns what was done, for people. `target`
    (to speculators): recorded as the verifier, with the target states an EAGLE-3 head fuses."""
    what = f"head '{source}'"
    if to not in LAYOUTS:
        raise SpecbenchError(f"--to {to}: convert to {' or '.join(LAYOUTS)}")
    raw = read_config(str(source), "head")
    family = family_of(raw, what)
    if speculators.is_speculators(raw) == (to == "speculators"):
        raise SpecbenchError(f"{what} is in the {to} layout already")
    if out.resolve() == source.resolve():
        raise SpecbenchError(f"--out {out} is the head's own folder: write the converted head to another")
    state = read_weights(source, eagle.FILES, what)
    if to == "speculators":
        verifier = speculators.verifier_of(target)
        if family == "eagle3":
            layers = None if verifier is None else list(feature_layers(verifier["num_hidden_layers"]))
            config = speculators.eagle3_speculators(raw, verifier, layers)
            state = speculators.eagle3_speculators_state(state)
        else:
            config = speculators.dflash_speculators(raw, verifier)
    elif family == "eagle3":
        config, state = speculators.eagle3_official(raw, what), speculators.eagle3_official_state(state)
    else:
        config, state = speculators.dflash_official(raw, what), speculators.dflash_official_state(state)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for item in source.iterdir():  # token counts, accuracy, a card
        if item.is_file() and item.name not in ("config.json", *eagle.FILES):
            shutil.copy2(item, staging / item.name)
    speculators.write(config, state, staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return f"{family} {what} written in the {to} layout to {out}"
