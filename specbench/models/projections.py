"""Projections that read one input as one product (`--graphs`): a decoder layer's q/k/v and its MLP's gate/up are
separate matrix-vector products in transformers' layout, each a kernel a little short of the memory bandwidth (on an
H200 at vicuna-7b's shapes, the one-row products of a forward took 4.4 ms apart and 3.8 ms fused: 72% and 84% of
the copy bandwidth; docs/gpu-notes.md). vLLM and gpt-fast load them concatenated; here the owner (an attention or
MLP module) computes the concatenated product on its input and each projection returns its columns of it. The
projections' weights become views of the concatenated one (no memory is added), and a projection called on any
other tensor computes its own product as before, so outputs are the projections' whatever the owner's code does;
only owners whose source applies every projection to the forward's first argument are fused (DFlash's attention
reads its keys from other rows, so it keeps its own). Each output element is the same dot product, summed by the
library's kernel for the larger matrix: last bits may differ from the separate products', as any two kernels'.

Queries and keys then lie side by side in one tensor, and the owner's module rotates them as one (`_rotate_jointly`):
transformers' rotary position embedding is five elementwise kernels for each of the two (20 µs of a 7B layer's
captured forward on an H200), the same five over both at once; each element's arithmetic is unchanged. And a gated
MLP whose forward is Llama's, `down(silu(gate) * up)`, reads its gate and up from the one product's halves.

On a GPU in float16 or bfloat16 the rotation and the gate's `silu(gate) * up` each run as one Triton kernel
(`core.kernels`), where a probe finds the module's rotation to be Llama's bit for bit."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
from torch import nn
from transformers import activations

from ..core import kernels

GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Product:
    """The concatenated product of one owner's forward: its input (the tensor itself) and output, set while the
    owner's forward runs, None otherwise."""

    def __init__(self, fused: nn.Linear) -> None:
        self.fused = fused
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None


def fuse_projections(module: nn.Module) -> nn.Module:
    """Every group of GROUPS in `module` whose owner applies all its projections to the forward's input becomes
    one product (in place; the state dict gains the concatenated weights, e.g. `self_attn.qkv_proj.weight`).
    Returns `module`."""
    for owner in list(module.modules()):
        for fused_name, names in GROUPS.items():
            parts = [getattr(owner, name, None) for name in names]
            if hasattr(owner, fused_name) or not _fusable(owner, names, parts):
                continue
            _fuse(owner, fused_name, parts)
    return module


def _fusable(owner: nn.Module, names: tuple[str, ...], parts: list) -> bool:
    """Linear layers of one class, input size, dtype, device and bias presence, with plain floating weights (not a
    quantized library's), each applied to the owner's first argument in its forward's source."""
    if not all(isinstance(p, nn.Linear) and type(p.weight) is nn.Parameter and p.weight.is_floating_point()
               for p in parts):  # fmt: skip
        return False
    first = parts[0]
    if any((type(p), p.in_features, p.weight.dtype, p.weight.device, p.bias is None)
           != (type(first), first.in_features, first.weight.dtype, first.weight.device, first.bias is None)
           for p in parts):  # fmt: skip
        return False
    source, argument = _source_and_input(type(owner))
    return argument is not None and all(f"self.{name}({argument})" in source for name in names)


def _source_and_input(kind: type) -> tuple[str, str | None]:
    """The source of `kind`'s forward (of the class that defines it, past our own subclasses) and the name of its
    first argument after self (None where it cannot be read)."""
    while kind in _subclasses.values():
        kind = kind.__mro__[1]
    forward = kind.forward
    try:
        source = inspect.getsource(forward)
        parameters = list(inspect.signature(forward).parameters)
    except (OSError, TypeError, ValueError):
        return "", None
    return source, parameters[1] if len(parameters) > 1 else None


@torch.no_grad()
def _fuse(owner: nn.Module, fused_name: str, parts: list[nn.Linear]) -> None:
    weight = torch.cat([p.weight for p in parts])
    bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    fused.__class__ = type(parts[0])  # (the parts' own: the few-row layout on a CPU)
    setattr(owner, fused_name, fused)
    product = Product(fused)
    start = 0
    for part in parts:
        stop = start + part.out_features
        part.weight = nn.Parameter(weight[start:stop], requires_grad=False)  # views: the separate copies are freed
        if bias is not None:
            part.bias = nn.Parameter(bias[start:stop], requires_grad=False)
        part.product, part.columns = product, slice(start, stop)
        part.__class__ = _subclass(type(part), _part_forward)
        start = stop
    if fused_name == "qkv_proj":
        _rotate_jointly(type(owner))
    products = owner.__dict__.setdefault("products", [])
    products.append(product)
    if len(products) == 1:
        gated = fused_name == "gate_up_proj" and _silu_gated(owner)
        owner.__class__ = _subclass(type(owner), _gated_forward if gated else _owner_forward(type(owner)))


_subclasses: dict[tuple[type, str], type] = {}  # (class, forward's name) -> the subclass


def _subclass(kind: type, forward: Callable) -> type:
    """`kind` with `forward` (one subclass per class and forward, so that modules of a class share it)."""
    key = (kind, forward.__qualname__)
    if key not in _subclasses:
        _subclasses[key] = type(kind.__name__, (kind,), {"forward": forward, "__doc__": kind.__doc__})
    return _subclasses[key]


def _part_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The projection's columns of its owner's product where `x` is that product's input; its own product else."""
    product = self.product
    if product.input is x:
        return product.output[..., self.columns]
    return type(self).__mro__[1].forward(self, x)


def _owner_forward(kind: type) -> Callable:
    """`kind`'s forward, with its products computed on its input first and released after."""
    argument = _source_and_input(kind)[1]

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs[argument]
        for product in self.products:
            product.input, product.output = x, product.fused(x)
        try:
            return kind.forward(self, *args, **kwargs)
        finally:
            for product in self.products:
                product.input = product.output = None

    forward.__qualname__ = f"fused_{kind.__qualname__}_forward"
    return forward


def _rotate_jointly(kind: type) -> None:
    """The module defining `kind` rotates adjacent queries and keys as one tensor (its `apply_rotary_pos_emb`
    wrapped, once)."""
    module = sys.modules.get(kind.__module__)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None or getattr(original, "joint", False):
        return

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        joint = None if torch.compiler.is_compiling() else _side_by_side(q, k)  # (inductor fuses them anyway)
        if joint is None:
            return original(q, k, cos, sin, *args, **kwargs)
        if not args and not kwargs and kernels.rotates(joint, cos, sin) and _rotates_alike(original, joint, cos):
            rotated = kernels.rotate(joint, cos, sin)
        else:
            rotated = original(joint, joint[:, :0], cos, sin, *args, **kwargs)[0]  # (an empty one launches nothing)
        return rotated[:, : q.shape[1]], rotated[:, q.shape[1] :]

    apply_rotary_pos_emb.joint = True
    apply_rotary_pos_emb.__doc__ = original.__doc__
    module.apply_rotary_pos_emb = apply_rotary_pos_emb


def _side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[batch, q heads + k heads, rows, head dim]: `q` and `k` as one view where both lie in one storage with k's
    heads right after q's, strided alike (one product's columns, split into heads and transposed); None otherwise.
    A dimension of size one may carry any stride (a one-row forward's q and k differ there)."""
    if q.dim() != 4 or k.dim() != 4 or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None
    batch, heads, rows, size = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, rows, size):
        return None
    if k.storage_offset() != q.storage_offset() + heads * size:
        return None
    strides = (q.stride(0), size, q.stride(2), 1)  # the joint view's
    for tensor in (q, k):
        if any(n > 1 and got != want for n, got, want in zip(tensor.shape, tensor.stride(), strides, strict=True)):
            return None
    return q.as_strided((batch, heads + k.shape[1], rows, size), strides)


_alike: dict[tuple, bool] = {}  # (rotation, dtype, device, head dim) -> whether `kernels.rotate` computes it


@torch.inference_mode()
def _rotates_alike(original: Callable, x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `kernels.rotate` gives `original`'s rotation bit for bit on a probe (random queries, keys and angles
    of x's dtype, device and head dim), decided once; during a capture, before any verdict, no (nothing may run but
    the forward)."""
    key = (original, x.dtype, x.device, x.shape[-1])
    if key not in _alike:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        generator = torch.Generator(x.device).manual_seed(0)
        probe, angles = (torch.randn(shape, generator=generator, device=x.device).mul(4).to(x.dtype)
                         for shape in ((1, 3, 5, x.shape[-1]), (2, 5, x.shape[-1])))  # fmt: skip
        cos, sin = angles[:1].to(cos.dtype), angles[1:].to(cos.dtype)
        _alike[key] = torch.equal(kernels.rotate(probe, cos, sin), original(probe, probe[:, :0], cos, sin)[0])
    return _alike[key]


GATED = "self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))"  # Llama's MLP, spaces removed


def _silu_gated(owner: nn.Module) -> bool:
    """Whether `owner`'s forward is Llama's gated MLP with a SiLU."""
    source, _ = _source_and_input(type(owner))
    silu = (nn.SiLU, getattr(activations, "SiLUActivation", nn.SiLU))
    return GATED in "".join(source.split()) and isinstance(getattr(owner, "act_fn", None), silu)


def _gated_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Llama's gated MLP over the one product of gate and up (its halves); `silu(gate) * up` in one kernel where
    `core.kernels` serves."""
    both = self.gate_up_proj(x)
    if kernels.gates(both):
        return self.down_proj(kernels.silu_and_mul(both))
    gate, up = both.chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)
