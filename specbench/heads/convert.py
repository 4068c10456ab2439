"""A head folder converted between its official layout and vLLM's speculators format (EAGLE-3 and P-EAGLE heads,
DFlash, DFlash2 and DSpark drafters): which family a folder holds, the translation (`speculators`), its other files
copied beside, and nothing half-written at the destination. Everything but the tensors is judged before torch is
imported: a mistake is one line at once."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import SpecbenchError
from . import speculators
from .folder import EAGLE_FILES, first, read_config

LAYOUTS = ("speculators", "official")


def family_of(raw: dict, what: str) -> str:
    """ "eagle3", "peagle", "dflash", "dflash2" or "dspark", from a config.json in either layout; any other head is
    one error line."""
    kind = raw.get("speculators_model_type")
    if kind in ("eagle3", "peagle", "dflash", "dflash2", "dspark"):
        return kind
    if kind is None and "draft_vocab_size" in raw:
        return "peagle" if "mask_token_id" in raw else "eagle3"
    architectures = raw.get("architectures") or []
    if kind is None and "DFlashDraftModel" in architectures:
        return "dflash"
    if kind is None and "DFlash2DraftModel" in architectures:
        return "dflash2"
    if kind is None and "Qwen3DSparkModel" in architectures:
        return "dspark"
    found = f"a speculators '{kind}' checkpoint" if kind else "not an EAGLE-3, P-EAGLE, DFlash(2) or DSpark head"
    raise SpecbenchError(
        f"{what} is {found}: only EAGLE-3 and P-EAGLE heads and DFlash, DFlash2 and DSpark drafters convert"
    )


def _check_out(out: Path, source: Path, force: bool) -> None:
    """--out is another folder than the head's, and holds nothing that converting would replace unless `force`."""
    if out.resolve() == source.resolve():
        raise SpecbenchError(f"--out {out} is the head's own folder: write the converted head to another")
    if out.exists() and not out.is_dir():
        raise SpecbenchError(f"--out {out} is a file: pass a folder for the converted head")
    if not force and out.is_dir() and any(out.iterdir()):
        raise SpecbenchError(
            f"--out {out} is not empty: pass --force to replace what it holds, or a new or empty folder"
        )


def _config(raw: dict, family: str, to: str, target: str | None, what: str) -> dict:
    """The converted config.json; `target` (to speculators): recorded as the verifier, with the target states an
    EAGLE-3 head fuses."""
    if to == "official":
        if family == "dflash":
            return speculators.dflash_official(raw, what)
        if family == "dspark":
            return speculators.dspark_official(raw, what)
        if family == "dflash2":
            return speculators.dflash2_official(raw, what)
        return speculators.eagle3_official(raw, what, family)
    verifier = speculators.verifier_of(target)
    if family == "dflash":
        return speculators.dflash_speculators(raw, verifier)
    if family == "dspark":
        return speculators.dspark_speculators(raw, verifier)
    if family == "dflash2":
        return speculators.dflash2_speculators(raw, verifier)
    from .eagle3 import feature_layers  # imports torch: the head itself has passed every check

    layers = None if verifier is None else list(feature_layers(verifier["num_hidden_layers"]))
    return speculators.eagle3_speculators(raw, verifier, layers, family)


def convert(source: Path, to: str, out: Path, target: str | None = None, force: bool = False) -> str:
    """Convert the head folder `source` to the layout `to` in `out` (which must hold nothing unless `force`);
    returns what was done, for people."""
    what = f"head '{source}'"
    if to not in LAYOUTS:
        raise SpecbenchError(f"--to {to}: convert to {' or '.join(LAYOUTS)}")
    if not source.is_dir():
        raise SpecbenchError(
            f"head folder '{source}' does not exist: pass the folder of an EAGLE-3 or P-EAGLE head or a DFlash drafter"
        )
    raw = read_config(source, "head")
    family = family_of(raw, what)
    if speculators.is_speculators(raw) == (to == "speculators"):
        raise SpecbenchError(f"{what} is in the {to} layout already")
    _check_out(out, source, force)
    first(source, EAGLE_FILES, "head")  # its weights are there
    config = _config(raw, family, to, target, what)
    from .checkpoint import read_weights  # imports torch: everything else has passed

    state = read_weights(source, EAGLE_FILES, "head")
    blocks = family in ("dflash", "dflash2", "dspark")  # (their tensors keep their names both ways)
    if to == "official":
        state = speculators.dflash_official_state(state) if blocks else speculators.eagle3_official_state(state)
    elif not blocks:
        state = speculators.eagle3_speculators_state(state)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for item in source.iterdir():  # token counts, accuracy, a card
        if item.is_file() and item.name not in ("config.json", *EAGLE_FILES):
            shutil.copy2(item, staging / item.name)
    speculators.write(config, state, staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return f"{family} {what} written in the {to} layout to {out}"
