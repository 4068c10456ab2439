"""Llama-style decoder layers (`--graphs` on a GPU) add the attention's output to the residual stream inside the
post-attention norm's kernel (`core.kernels.add_rms_norm`): one kernel fewer a layer. The layer's forward is
transformers' own statement for statement (`_passed`, read with `ast`: Llama, Qwen2, Mistral and the heads built
from them), so the replacement runs the same modules on the same arguments and changes only where the add runs;
layers written otherwise (DFlash's, Gemma's) keep theirs, and so does a call whose arguments the replacement cannot
place, or one torch.compile traces (inductor fuses the add itself). EAGLE-3's layer, our own, calls `add_norm`."""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
from torch import nn

from ..core import kernels
from .norms import rms_norm

LLAMA = """
def forward(self, hidden_states):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn()
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
"""  # a decoder layer's forward, its attention's arguments left out (`_passed` reads them)


class Plan:
    """How a layer class's forward hands its arguments to its attention: by these names, then its **kwargs."""

    def __init__(self, kind: type, names: list[str], rest: str | None) -> None:
        self.forward = kind.forward
        self.signature = inspect.signature(kind.forward)
        self.names = names
        self.rest = rest


_plans: dict[type, Plan] = {}  # a layer's fused subclass -> its plan
_fused: dict[type, type | None] = {}  # a layer class -> its fused subclass; None: written otherwise


def fuse_residuals(module: nn.Module) -> nn.Module:
    """Every decoder layer of `module` whose forward is transformers' Llama-style one, on tensors the kernels serve,
    adds its attention's output in the post-attention norm's kernel (in place: its class becomes a subclass).
    Returns `module`."""
    for layer in module.modules():
        kind = type(layer)
        if kind in _plans or not _served(layer):
            continue
        if kind not in _fused:
            passed = _passed(kind)
            _fused[kind] = None if passed is None else type(kind.__name__, (kind,), {"forward": _forward,
                                                                                     "__doc__": kind.__doc__})
            if passed is not None:
                _plans[_fused[kind]] = Plan(kind, *passed)
        if _fused[kind] is not None:
            layer.__class__ = _fused[kind]
    return module


def _served(layer: nn.Module) -> bool:
    """A layer with an attention, an MLP and a post-attention norm whose weight the kernels serve."""
    norm = getattr(layer, "post_attention_layernorm", None)
    weight = getattr(norm, "weight", None)
    parts = (getattr(layer, "self_attn", None), getattr(layer, "mlp", None))
    return all(isinstance(p, nn.Module) for p in parts) and isinstance(weight, torch.Tensor) and kernels.usable(weight)


def _passed(kind: type) -> tuple[list[str], str | None] | None:
    """The names `kind`'s forward passes its attention unchanged (`name=name`) and its **kwargs' name, where its
    body is LLAMA's statement for statement; None otherwise."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(kind.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef):
        return None
    if function.body and isinstance(function.body[0], ast.Expr) and isinstance(function.body[0].value, ast.Constant):
        function.body = function.body[1:]  # (a docstring)
    if len(function.body) != 9:
        return None
    attend = function.body[2]
    call = getattr(attend, "value", None)
    if not isinstance(call, ast.Call) or call.args:
        return None
    names, rest = [], None
    for keyword in call.keywords:
        if keyword.arg is None and isinstance(keyword.value, ast.Name):
            rest = keyword.value.id
        elif isinstance(keyword.value, ast.Name) and keyword.value.id == keyword.arg:
            names.append(keyword.arg)
        else:
            return None
    parameters = inspect.signature(kind.forward).parameters
    kwargs = next((p.name for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if "hidden_states" not in names or rest != kwargs or any(n not in parameters for n in names):
        return None
    call.keywords = []
    expected = ast.parse(LLAMA).body[0].body
    if [ast.dump(s) for s in function.body] != [ast.dump(s) for s in expected]:
        return None
    return [n for n in names if n != "hidden_states"], rest


def _forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The layer's own forward, its attention's output added to the residual inside the post-attention norm's
    kernel where the kernels serve."""
    plan = _plans[type(self)]
    if torch.compiler.is_compiling():
        return plan.forward(self, hidden_states, *args, **kwargs)
    try:
        bound = plan.signature.bind(self, hidden_states, *args, **kwargs)
    except TypeError:
        return plan.forward(self, hidden_states, *args, **kwargs)
    bound.apply_defaults()
    arguments = {name: bound.arguments[name] for name in plan.names}
    attended, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **arguments,
                                 **(bound.arguments.get(plan.rest) or {}))  # fmt: skip
    total, normed = add_norm(self.post_attention_layernorm, attended, hidden_states)
    return total + self.mlp(normed)


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual + x` and `norm` of it: one kernel where `norm` runs as `rms_norm` (`models.norms`) on tensors the
    kernels serve, else the add and the norm's own forward."""
    if (type(norm).forward is rms_norm and x.shape == residual.shape and kernels.norms(x, norm.weight)
            and kernels.norms(residual, norm.weight)):  # fmt: skip
        return kernels.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    total = residual + x
    return total, norm(total)
