"""A method's preset as vLLM's speculative_config (its `vllm:` key): which methods engine mode can run, and the
mapping with the method's params and checkpoint folders filled in."""

from __future__ import annotations

from pathlib import Path

from .. import methods
from ..errors import SpecbenchError


def why_not(name: str) -> str | None:
    """Why vLLM cannot run a method (its preset's `vllm:` says), or None when it can."""
    mapping = methods.preset(name).vllm
    if mapping is None:
        return "its preset maps it to no vLLM speculative_config (no `vllm:` key)"
    return mapping if isinstance(mapping, str) else None


def restrict(names: list[str], skipped: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The methods vLLM can run, and the skipped ones with those it cannot added (each with its reason)."""
    cannot = {name: f"not in engine mode: {why}" for name in names if (why := why_not(name))}
    return [n for n in names if n not in cannot], {**skipped, **cannot}


def speculative_config(name: str, paths: dict[str, Path]) -> dict | None:
    """vLLM's speculative_config for a method: its preset's `vllm:` mapping, `$param` replaced by the method's
    params (a variant's included) and `model: NEED` ("draft", "eagle head", ...) by that checkpoint's folder (the
    named head a variant asks for: `eagle3[head=redhat]`). None: plain decoding."""
    spec = methods.preset(name)
    assert isinstance(spec.vllm, dict)  # `restrict` keeps only the methods with a mapping
    keys = {f"{n.family} head": f"{n.key} head" for n in methods.needs(name) if n.kind == "head"}
    out = {}
    for key, value in spec.vllm.items():
        if isinstance(value, str) and value.startswith("$"):
            if value[1:] not in spec.params:
                raise SpecbenchError(f"method preset '{name}': vllm.{key} is {value}, not one of its params")
            value = spec.params[value[1:]]
        elif key == "model":
            value = keys.get(value, value)
            if value not in paths:
                raise SpecbenchError(f"method preset '{name}': vllm.model is '{value}', which it does not need")
            value = str(paths[value])
        out[key] = value
    return out or None
