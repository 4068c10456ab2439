"""One Triton kernel each for elementwise work that torch runs as a chain of kernels (`--graphs` on a GPU): inside a
captured 7B forward every kernel costs a few microseconds however little it does, and these chains were most of
the ~500 small kernels beside the 200 products (docs/gpu-notes.md). Each kernel rounds where torch's chain rounds
(no fused multiply-adds), so its outputs are torch's bit for bit (the norm's mean up to its summation order, the
SiLU's exponential up to the device's `exp`):

- `rotate`: transformers' rotary embedding, `x * cos + rotate_half(x) * sin` (five kernels), over queries and keys
  side by side (`models.projections`);
- `write_rows`: a forward's keys and values into their cache rows (two `index_copy_`, `StaticRows.update`);
- `rms_norm`: Llama's RMSNorm and the weight's product (two kernels, `models.norms`), and `add_rms_norm` with the
  residual add before it (three, `models.residuals`);
- `silu_and_mul`: a gated MLP's `silu(gate) * up` (two kernels, `models.projections`).

They serve float16 and bfloat16 tensors on a GPU with Triton installed (torch's CUDA builds bring it; `usable`);
anything else keeps torch's ops. On a CPU the tests run them through Triton's interpreter (`interpreted`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # (a CPU build of torch comes without Triton: every caller keeps torch's ops)
    triton = tl = None

DTYPES = (torch.float16, torch.bfloat16)
_interpret = False  # `interpreted`: CPU tensors through Triton's interpreter (tests)
_off = False  # `disabled`


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels serve these tensors: Triton present, all on one GPU (or on the CPU while `interpreted`),
    float16 or bfloat16, not traced by torch.compile (inductor fuses the chains itself)."""
    if triton is None or _off or tensors[0].device.type != ("cpu" if _interpret else "cuda"):
        return False  # (first, and cheaply: every CPU forward asks, layer by layer)
    first = tensors[0]
    return first.dtype in DTYPES and not torch.compiler.is_compiling() and all(
        t.device == first.device and t.dtype == first.dtype for t in tensors)


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels run on `device`'s tensors of `dtype` (what a run's manifest records)."""
    return triton is not None and not _off and device.type == "cuda" and dtype in DTYPES


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """A block in which the kernels take CPU tensors and run on Triton's interpreter (slow; for tests). Triton reads
    TRITON_INTERPRET=1 when it is imported (its own library functions are compiled or interpreted from then on)."""
    global _interpret
    if triton is None or not triton.knobs.runtime.interpret:
        raise RuntimeError("Triton's interpreter needs Triton installed and TRITON_INTERPRET=1 before it is imported")
    _interpret, before = True, _interpret
    try:
        yield
    finally:
        _interpret = before


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """A block in which every caller keeps torch's ops (to measure what the kernels save)."""
    global _off
    _off, before = True, _off
    try:
        yield
    finally:
        _off = before


@functools.cache
def _compiled(body: Callable):
    return triton.jit(body)


def _launch(body: Callable, grid: tuple[int, ...], *args, **constants) -> None:
    """`body` over `grid`, each operation rounded apart as torch's kernels round them: the compiler's default would
    contract a product and a sum into one fused multiply-add, rounded once (`FUSION`)."""
    _compiled(body)[grid](*args, **constants, **FUSION)


FUSION = {"enable_fp_fusion": False}  # (a compile option; tests/test_kernels.py compiles with it for sm_80 and sm_90)


def _block(size: int) -> int:
    return triton.next_power_of_2(size)


# rotate ---------------------------------------------------------------------------------------------------------


def _rotate_kernel(x, cos, sin, out, heads, rows, sxb, sxh, sxn, scb, scn, half, BLOCK: tl.constexpr):
    # one program per (batch, head, row): out[b, h, n, :] (contiguous) from x's strided row and cos/sin[b, n, :]
    b, h, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = tl.arange(0, BLOCK)
    inside = d < half
    src = x + b * sxb + h * sxh + n * sxn
    x1 = tl.load(src + d, mask=inside).to(tl.float32)
    x2 = tl.load(src + half + d, mask=inside).to(tl.float32)
    at = cos + b * scb + n * scn
    c1 = tl.load(at + d, mask=inside).to(tl.float32)
    c2 = tl.load(at + half + d, mask=inside).to(tl.float32)
    at = sin + b * scb + n * scn
    s1 = tl.load(at + d, mask=inside).to(tl.float32)
    s2 = tl.load(at + half + d, mask=inside).to(tl.float32)
    kind = out.dtype.element_ty
    # torch rounds each product and the sum to the dtype: x * cos, rotate_half(x) * sin = (-x2, x1) * sin, then +
    first = (x1 * c1).to(kind).to(tl.float32) + (-x2 * s1).to(kind).to(tl.float32)
    second = (x2 * c2).to(kind).to(tl.float32) + (x1 * s2).to(kind).to(tl.float32)
    dst = out + ((b * heads + h) * rows + n) * (2 * half)
    tl.store(dst + d, first.to(kind), mask=inside)
    tl.store(dst + half + d, second.to(kind), mask=inside)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` for x [batch, heads, rows, head dim] (any strides, the last dimension's
    1) and cos, sin [batch, rows, head dim] (any strides, the last dimension's 1; batch may broadcast): a new
    contiguous tensor."""
    batch, heads, rows, size = x.shape
    if cos.shape[0] == 1 and batch > 1:  # (one rotation for every sequence)
        cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
    out = torch.empty((batch, heads, rows, size), dtype=x.dtype, device=x.device)
    if out.numel():
        _launch(_rotate_kernel, (batch, heads, rows), x, cos, sin, out, heads, rows, x.stride(0), x.stride(1),
                x.stride(2), cos.stride(0), cos.stride(1), size // 2, BLOCK=_block(size // 2))  # fmt: skip
    return out


def rotates(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotate` takes these (shapes and strides as it reads them; `usable`)."""
    return (usable(x, cos, sin) and x.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
            and cos.stride() == sin.stride() and x.shape[-1] % 2 == 0 and cos.shape[-1] == x.shape[-1]
            and cos.shape[1] == x.shape[2] and cos.shape[0] in (1, x.shape[0])
            and x.stride(-1) == 1 and cos.stride(-1) == 1)  # fmt: skip


# write_rows -----------------------------------------------------------------------------------------------------


def _write_rows_kernel(keys, values, at, k, v, skb, skh, skn, svb, svh, svn, scb, sch, scn, size, BLOCK: tl.constexpr):
    # one program per (batch, head, row): keys/values[b, h, at[n], :] = k/v[b, h, n, :]
    b, h, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = tl.arange(0, BLOCK)
    inside = d < size
    row = tl.load(at + n)
    dst = b * scb + h * sch + row * scn + d
    tl.store(keys + dst, tl.load(k + b * skb + h * skh + n * skn + d, mask=inside), mask=inside)
    tl.store(values + dst, tl.load(v + b * svb + h * svh + n * svn + d, mask=inside), mask=inside)


def write_rows(keys: torch.Tensor, values: torch.Tensor, at: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """keys[:, :, at] = k and values[:, :, at] = v in one kernel: caches [batch, heads, rows, head dim] alike
    strided, k and v [batch, heads, n, head dim] (last dimension contiguous), at [n] distinct rows."""
    batch, heads, rows, size = k.shape
    if rows:
        _launch(_write_rows_kernel, (batch, heads, rows), keys, values, at, k, v, *k.stride()[:3],
                *v.stride()[:3], *keys.stride()[:3], size, BLOCK=_block(size))  # fmt: skip


def writes_rows(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `write_rows` takes these (`usable`; shapes and strides as it reads them)."""
    return (usable(keys, values, k, v) and keys.stride() == values.stride() and k.shape == v.shape
            and keys.dim() == k.dim() == 4 and keys.shape[:2] == k.shape[:2] and keys.shape[3] == k.shape[3]
            and keys.stride(-1) == k.stride(-1) == v.stride(-1) == 1)  # fmt: skip


# rms_norm -------------------------------------------------------------------------------------------------------


def _rms_norm_kernel(x, residual, weight, total, out, sx, sr, so, size, eps, ADD: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    # one program per row: out = round(round(x * rsqrt(mean(x²) + eps)) * weight), float32 inside; with ADD, x is
    # first round(x + residual), stored to `total` (contiguous rows; out's rows `so` apart)
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    inside = d < size
    kind = out.dtype.element_ty
    values = tl.load(x + row * sx + d, mask=inside, other=0.0).to(tl.float32)
    if ADD:
        values = (values + tl.load(residual + row * sr + d, mask=inside, other=0.0).to(tl.float32)).to(kind)
        tl.store(total + row * size + d, values, mask=inside)
        values = values.to(tl.float32)
    scale = tl.rsqrt(tl.sum(values * values, axis=0) / size + eps)
    normed = (values * scale).to(kind).to(tl.float32)
    w = tl.load(weight + d, mask=inside).to(tl.float32)
    tl.store(out + row * so + d, (normed * w).to(kind), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`F.rms_norm(x, weight's shape, None, eps) * weight` in one kernel: x [..., size] (rows any stride, the last
    dimension contiguous), weight [size] of x's dtype; into `out` (shaped as x, its rows evenly strided, the last
    dimension contiguous: a part of a wider tensor) or a new contiguous tensor. Returns it."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"rms_norm writes rows of {tuple(x.shape)}, unit-strided, not into {tuple(out.shape)}")
    _norm(x, None, weight, eps, None, out)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`total = x + residual` and `rms_norm(total, weight, eps)` in one kernel (residual shaped as x, its rows any
    stride): both, new contiguous tensors."""
    total, out = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(2))
    _norm(x, residual, weight, eps, total, out)
    return total, out


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
          total: torch.Tensor | None, out: torch.Tensor) -> None:  # fmt: skip
    size = x.shape[-1]
    rows = x.reshape(-1, size)  # (a view where x's rows are evenly strided)
    added = rows if residual is None else residual.reshape(-1, size)
    written = out.view(-1, size)  # (a view: what the kernel writes is `out`'s own memory)
    if len(rows):
        block = _block(size)  # a whole row a program, with more warps for longer rows (as Liger-Kernel's norms)
        warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
        _launch(_rms_norm_kernel, (len(rows),), rows, added, weight, out if total is None else total, written,
                rows.stride(0), added.stride(0), written.stride(0), size, eps, ADD=residual is not None, BLOCK=block,
                num_warps=warps)  # fmt: skip


def norms(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes these (`usable`; a weight vector as long as x's rows, contiguous)."""
    return (usable(x, weight) and weight.dim() == 1 and x.shape[-1] == len(weight) and x.stride(-1) == 1
            and weight.stride(0) == 1)  # fmt: skip


# silu_and_mul ---------------------------------------------------------------------------------------------------


def _silu_and_mul_kernel(x, out, stride, size, BLOCK: tl.constexpr):
    # one program per (row, block of columns): out = round(round(silu(gate)) * up), gate and up the row's halves
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = d < size
    gate = tl.load(x + row * stride + d, mask=inside).to(tl.float32)
    up = tl.load(x + row * stride + size + d, mask=inside).to(tl.float32)
    kind = out.dtype.element_ty
    act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(kind).to(tl.float32)  # (rounded as torch's division)
    tl.store(out + row * size + d, (act * up).to(kind), mask=inside)


SILU_BLOCK = 1024  # columns a program of `silu_and_mul` computes


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` in one kernel, x [..., 2 * size] the gate's columns then the up's (rows any stride, the
    last dimension contiguous): a new contiguous tensor [..., size]."""
    size = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * size)
    out = torch.empty((*x.shape[:-1], size), dtype=x.dtype, device=x.device)
    if len(rows) and size:
        block = min(_block(size), SILU_BLOCK)
        _launch(_silu_and_mul_kernel, (len(rows), triton.cdiv(size, block)), rows, out, rows.stride(0), size,
                BLOCK=block)  # fmt: skip
    return out


def gates(x: torch.Tensor) -> bool:
    """Whether `silu_and_mul` takes x (`usable`; an even last dimension, contiguous)."""
    return usable(x) and x.shape[-1] % 2 == 0 and x.stride(-1) == 1
