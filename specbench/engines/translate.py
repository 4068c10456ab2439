"""A method's preset as an engine's settings: vLLM's speculative_config (its `vllm:` key) or llama-server's flags
(its `llamacpp:` key). Which methods an engine can run, and the mapping with the method's params and checkpoint
files filled in."""

from __future__ import annotations

from pathlib import Path

from .. import methods
from ..errors import SpecbenchError
from ..presets import ENGINES, variant

MODEL_KEY = {"vllm": "model", "llamacpp": "spec-draft-model"}  # the setting naming a checkpoint the method needs


def mapping(name: str, engine: str) -> dict | str | None:
    assert engine in ENGINES
    return getattr(methods.preset(name), engine)


def why_not(name: str, engine: str = "vllm") -> str | None:
    """Why an engine cannot run a method (its preset's key says), or None when it can; a variant that changes a
    parameter the engine's settings do not carry (`dflash[tree=32]`: no engine builds DDTree's trees) would run as
    something else there, so it cannot either."""
    found = mapping(name, engine)
    if found is None:
        return f"its preset maps it to nothing in {engine} (no `{engine}:` key)"
    if isinstance(found, str):
        return found
    carried = {param for value in found.values() if (param := _param(value))}
    params, defaults = methods.preset(name).params, methods.preset(variant(name)[0]).params
    changed = [key for key, value in params.items() if key not in carried and defaults.get(key) != value]
    if changed:
        return f"its {changed[0]}={params[changed[0]]} has no setting in {engine}'s mapping"
    return None


def restrict(names: list[str], skipped: dict[str, str], engine: str = "vllm") -> tuple[list[str], dict[str, str]]:
    """The methods the engine can run, and the skipped ones with those it cannot added (each with its reason)."""
    cannot = {name: f"not in engine mode: {why}" for name in names if (why := why_not(name, engine))}
    return [n for n in names if n not in cannot], {**skipped, **cannot}


def filled(name: str, engine: str, paths: dict[str, Path]) -> dict:
    """The method's mapping for the engine, `$param` replaced by the method's params (a variant's included) and the
    checkpoint setting's NEED ("draft", "eagle3 head", ...) by that checkpoint's path in `paths` (the named head a
    variant asks for: `eagle3[head=redhat]`)."""
    spec, found = methods.preset(name), mapping(name, engine)
    assert isinstance(found, dict)  # `restrict` keeps only the methods with a mapping
    out = {}
    for key, value in found.items():
        param = _param(value)
        if param is not None:
            if param not in spec.params:
                raise SpecbenchError(f"method preset '{name}': {engine}.{key} reads ${param}, not one of its params")
            given = spec.params[param]
            if isinstance(value, dict):  # {$param: {its value: the engine's}}
                table = value[f"${param}"]
                if given not in table:
                    raise SpecbenchError(
                        f"{name}: {param}={given} has no {engine} setting; its {engine}.{key} maps "
                        f"{', '.join(map(str, table))}"
                    )
                given = table[given]
                if given is None:  # (the engine's default: the setting left out)
                    continue
            value = given
        elif key == MODEL_KEY[engine]:
            value = _need(name, value)
            if value not in paths:
                raise SpecbenchError(f"method preset '{name}': {engine}.{key} is '{value}', which it does not need")
            value = str(paths[value])
        out[key] = value
    return out


def _param(value: object) -> str | None:
    """The method parameter a mapping's value carries: `$param` (its value as it is), or `{$param: {value: the
    engine's}}` (its value through the table, null leaving the setting out); None for a constant."""
    if isinstance(value, str) and value.startswith("$"):
        return value[1:]
    if isinstance(value, dict) and len(value) == 1:
        (key,) = value
        if isinstance(key, str) and key.startswith("$") and isinstance(value[key], dict):
            return key[1:]
    return None


def speculative_config(name: str, paths: dict[str, Path]) -> dict | None:
    """vLLM's speculative_config for a method (None: plain decoding)."""
    return filled(name, "vllm", paths) or None


def needed(name: str, engine: str) -> str | None:
    """The need ("draft", "eagle3 head", ...) whose checkpoint the engine loads for the method, if any."""
    found = mapping(name, engine)
    if not isinstance(found, dict) or MODEL_KEY[engine] not in found:
        return None
    return _need(name, found[MODEL_KEY[engine]])


def _need(name: str, value: str) -> str:
    """A mapping's checkpoint NEED as `paths` keys it: a head family's own, or the named head a variant asks for."""
    keys = {f"{n.family} head": f"{n.key} head" for n in methods.needs(name) if n.kind == "head"}
    return keys.get(value, value)


def server_flags(name: str, files: dict[str, Path]) -> list[str]:
    """llama-server's command-line flags for a method (`files`: each needed checkpoint as GGUF)."""
    flags = []
    for key, value in filled(name, "llamacpp", files).items():
        flags += [f"--{key}"] + ([] if value is True else [str(value)])  # true: a switch without a value
    return flags
