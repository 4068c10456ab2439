"""`core.kernels`: each Triton kernel gives what the chain of torch ops it replaces gives, bit for bit (the norm's and
the SiLU's within a unit in the last place: a sum's order, the device's `exp`), in float16 on a CPU through Triton's
interpreter (which rounds bfloat16 its own way: bfloat16 on a GPU only), and `--graphs`' modules use them where they
apply, with the same logits."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import rotate_half

from specbench.core import kernels
from specbench.core.static_lm import StaticCachedLM
from specbench.models import projections, residuals
from specbench.models.loading import fuse_for_graphs

from .conftest import CUDA, random_llama, random_qwen2
from .test_projections import Ops

pytestmark = pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed")
CPU = pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile"))
DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(params=[CPU, CUDA])
def device(request):
    if request.param == "cuda":
        yield torch.device("cuda")
        return
    with kernels.interpreted():
        yield torch.device("cpu")


@pytest.fixture(params=DTYPES, ids=["float16", "bfloat16"])
def dtype(request, device):
    if request.param == torch.bfloat16 and device.type == "cpu":
        pytest.skip("Triton's interpreter rounds float32 to bfloat16 its own way (truncating, a carry lost)")
    return request.param


def _same(got: torch.Tensor, want: torch.Tensor, ulps: int = 0) -> None:
    """Bit for bit, or within `ulps` units in the last place."""
    if not ulps:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
        return
    tolerance = ulps * torch.finfo(got.dtype).eps
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def _joint(batch: int, rows: int, heads: int, kv: int, size: int, dtype, device) -> tuple[torch.Tensor, ...]:
    """Queries and keys side by side [batch, heads + kv, rows, size] as one product's columns lay them, and the
    values [batch, kv, rows, size] after them."""
    product = torch.randn(batch, rows, (heads + 2 * kv) * size, device=device).mul(3).to(dtype)
    q = product[..., : heads * size].view(batch, rows, heads, size).transpose(1, 2)
    v = product[..., (heads + kv) * size :].view(batch, rows, kv, size).transpose(1, 2)
    return q.as_strided((batch, heads + kv, rows, size), q.stride()), v


@pytest.mark.parametrize("size", [16, 20])  # (20: half a row is not a power of two)
def test_rotate_is_transformers_rotary_embedding(device, dtype, size):
    torch.manual_seed(0)
    joint, _ = _joint(2, 3, 4, 2, size, dtype, device)
    cos, sin = (torch.randn(2, 3, size, device=device).to(dtype) for _ in range(2))
    for c, s in ((cos, sin), (cos[:, :1].expand(2, 3, -1), sin[:, :1].expand(2, 3, -1)), (cos[:1], sin[:1])):
        assert kernels.rotates(joint, c, s)
        got = kernels.rotate(joint, c, s)
        assert got.is_contiguous() and got.shape == joint.shape
        _same(got, joint * c[:, None] + rotate_half(joint) * s[:, None])


def test_write_rows_is_two_index_copies(device, dtype):
    torch.manual_seed(0)
    joint, v = _joint(2, 3, 4, 2, 16, dtype, device)
    k = joint[:, 4:]
    stacked = [torch.zeros(2, 2, 3 * 40, 16, dtype=dtype, device=device) for _ in range(2)]  # three layers' rows
    at = torch.tensor([45, 49, 70], device=device)  # the second layer's rows 5, 9 and 30
    assert kernels.writes_rows(*stacked, k, v)
    kernels.write_rows(*stacked, at, k, v)
    keys, values = (torch.zeros_like(s) for s in stacked)
    keys.index_copy_(2, at, k)
    values.index_copy_(2, at, v)
    _same(stacked[0], keys)
    _same(stacked[1], values)


def test_rms_norm_is_torchs_and_the_weights_product_after_a_residual_add_or_not(device, dtype):
    torch.manual_seed(0)
    weight = torch.randn(48, device=device).to(dtype)
    rows = torch.randn(4, 100, device=device).to(dtype)[:, :48]  # (strided rows)
    for x in (torch.randn(3, 5, 48, device=device).mul(3).to(dtype), rows):
        assert kernels.norms(x, weight)
        _same(kernels.rms_norm(x, weight, 1e-6), F.rms_norm(x, weight.shape, None, 1e-6) * weight, ulps=1)
        residual = torch.randn(x.shape, device=device).to(dtype)
        total, normed = kernels.add_rms_norm(x, residual, weight, 1e-6)
        _same(total, residual + x)
        _same(normed, F.rms_norm(residual + x, weight.shape, None, 1e-6) * weight, ulps=1)


def test_silu_and_mul_is_the_gated_product(device, dtype):
    torch.manual_seed(0)
    for size in (40, 3000):  # (3000: three programs a row)
        both = torch.randn(2, 3, 2 * size, device=device).mul(3).to(dtype)
        assert kernels.gates(both)
        _same(kernels.silu_and_mul(both), F.silu(both[..., :size]) * both[..., size:], ulps=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU Triton compiles: its interpreter is off")
def test_the_kernels_serve_float16_and_bfloat16_on_their_device_only():
    half = torch.zeros(2, 4, dtype=torch.float16)
    assert not kernels.usable(half)  # a CPU tensor, outside the interpreter
    cuda = torch.device("cuda")  # (what a run's manifest records as graphs.fused_kernels)
    assert kernels.serves(cuda, torch.bfloat16) and not kernels.serves(cuda, torch.float32)
    assert not kernels.serves(torch.device("cpu"), torch.float16)
    with kernels.interpreted():
        assert kernels.usable(half) and not kernels.usable(half.float()) and not kernels.usable(half, half.float())
        with kernels.disabled():
            assert not kernels.usable(half)
        assert not kernels.gates(half[:, :3]) and not kernels.norms(half, torch.zeros(3, dtype=torch.float16))


def test_a_rotation_that_is_not_llamas_keeps_its_own(device):
    def interleaved(q, k, cos, sin):  # GPT-J's pairs (x0, x1), (x2, x3), ...: not the kernel's halves
        pairs = torch.stack([-q[..., 1::2], q[..., ::2]], dim=-1).flatten(-2)
        return q * cos[:, None] + pairs * sin[:, None], k

    joint, _ = _joint(1, 2, 4, 2, 16, torch.float16, device)
    assert projections._rotates_alike(modeling_llama.apply_rotary_pos_emb, joint, joint[0])
    assert not projections._rotates_alike(interleaved, joint, joint[0])


def test_the_gated_mlp_reads_gate_and_up_from_the_one_product():
    model = fuse_for_graphs(random_llama(50, layers=1, seed=0, init=0.1))
    mlp = model.model.layers[0].mlp
    assert type(mlp).forward is projections._gated_forward
    x = torch.randn(1, 3, model.config.hidden_size)
    with torch.inference_mode():
        want = mlp.down_proj(F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T))
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-6)
    gelu = random_llama(50, layers=1, seed=0)
    gelu.model.layers[0].mlp.act_fn = torch.nn.GELU()
    assert type(fuse_for_graphs(gelu).model.layers[0].mlp).forward is not projections._gated_forward


@pytest.mark.parametrize("family", [random_llama, random_qwen2], ids=["llama", "qwen2"])
def test_a_graphs_forward_on_the_kernels_gives_the_logits_of_torchs_ops(device, dtype, family):
    """Llama and Qwen2 (biased q/k/v) in float16 and bfloat16 through StaticCachedLM: a prefill and three one-token
    forwards (captured on a GPU), with the kernels and without; and the kernels cut the ops a layer runs."""
    model = fuse_for_graphs(family(60, layers=2, seed=0, init=0.1).to(device, dtype))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    def decode(lm) -> list[torch.Tensor]:
        lm.reset()
        logits = [lm.forward(prompt, last_only=True)[-1]]
        for token in (7, 8, 9):
            logits.append(lm.forward([token])[-1])
        return logits

    with kernels.disabled():
        torchs = decode(StaticCachedLM(model))
    lm = StaticCachedLM(model)
    own = decode(lm)
    for got, want in zip(own, torchs, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # (the norm's sum in another order)
        assert got.argmax() == want.argmax()
    if device.type == "cpu":  # the ops a one-token forward no longer runs (a GPU's captured forward dispatches none)
        counts = {}
        for off in (True, False):
            with kernels.disabled() if off else contextlib.nullcontext(), Ops() as ops:
                lm.forward([10])
            lm.crop(lm.cached - 1)
            counts[off] = ops.counts
        # a layer: two norms, the rotation's negation and sum, the cache's two writes, the SiLU, the attention's
        # residual add (and the final norm)
        for op, fewer in (("rms_norm", 5), ("neg", 2), ("add", 4), ("index_copy_", 4), ("silu", 2)):
            assert counts[True][op] - counts[False][op] == fewer, op
    assert all(type(layer) in residuals._plans for layer in model.model.layers)


COMPILE = textwrap.dedent("""
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from specbench.core import kernels
    ints = lambda *names: {name: "i32" for name in names}
    for arch in (80, 90):
        for dtype in ("fp16", "bf16"):
            p = "*" + dtype
            norm = {"x": p, "residual": p, "weight": p, "total": p, "out": p, **ints("sx", "sr", "so", "size"),
                    "eps": "fp32", "ADD": "constexpr"}
            for body, signature, constants in (
                (kernels._rotate_kernel, {"x": p, "cos": p, "sin": p, "out": p, **ints("heads", "rows", "sxb", "sxh",
                 "sxn", "scb", "scn", "half")}, {"BLOCK": 64}),
                (kernels._write_rows_kernel, {"keys": p, "values": p, "at": "*i64", "k": p, "v": p, **ints("skb", "skh",
                 "skn", "svb", "svh", "svn", "scb", "sch", "scn", "size")}, {"BLOCK": 128}),
                (kernels._rms_norm_kernel, norm, {"ADD": False, "BLOCK": 4096}),
                (kernels._rms_norm_kernel, norm, {"ADD": True, "BLOCK": 4096}),
                (kernels._silu_and_mul_kernel, {"x": p, "out": p, **ints("stride", "size")}, {"BLOCK": 1024}),
            ):
                source = ASTSource(triton.jit(body), {**signature, "BLOCK": "constexpr"}, constants)
                ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=kernels.FUSION).asm["ptx"]
                if body is kernels._rotate_kernel and arch == 90 and "fma." in ptx:  # (sm_80 has no bfloat16
                    # product or sum: it runs each as a multiply-add with a constant, rounded once all the same)
                    sys.exit(f"the rotation contracts a product and a sum ({dtype}, sm_{arch})")
    print("compiled")
""")


def test_the_kernels_compile_for_a_gpu_with_every_operation_rounded_apart():
    """Triton's NVIDIA backend compiles each kernel for sm_80 and sm_90 without a GPU (a kernel the interpreter runs
    may still not compile), and the rotation keeps its products and sums apart, as torch rounds them (with the
    compiler's default it fused them into multiply-adds, rounded once)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (Triton's own functions compiled)
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]


def test_a_layer_written_otherwise_keeps_its_forward():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    from specbench.heads.eagle3 import Eagle3Layer

    for kind in (LlamaDecoderLayer, Qwen2DecoderLayer):
        names, rest = residuals._passed(kind)
        assert "attention_mask" in names and "position_embeddings" in names and rest == "kwargs"

    class Reordered(LlamaDecoderLayer):  # the norm before the residual add: another computation
        def forward(self, hidden_states, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.mlp(hidden_states)
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    assert residuals._passed(Reordered) is None and residuals._passed(Eagle3Layer) is None


def test_an_eagle_head_calling_its_layer_by_position_gives_its_own_outputs(device):
    """EAGLE's head calls its decoder layer with positional arguments: the fused layer places them as the layer's
    own forward does (float16)."""
    from specbench.heads import eagle

    target = random_llama(60, layers=2, seed=0)
    torch.manual_seed(0)
    head = eagle.build(eagle.config_from_target(target.config)).to(device, torch.float16).eval()
    features = torch.randn(1, 5, head.feature_size, device=device).to(torch.float16)
    tokens, positions = torch.tensor([[3, 1, 4, 1, 5]], device=device), torch.arange(5, device=device)[None]
    with torch.inference_mode():
        own = head(features, tokens, positions)
        fuse_for_graphs(head)
        assert type(head.layers[0]) in residuals._plans
        fused = head(features, tokens, positions)
    torch.testing.assert_close(fused, own, rtol=2e-2, atol=2e-2)  # (the norm's sum in another order)


def test_an_eagle3_layer_writes_its_norms_side_by_side_and_adds_in_the_norm(device):
    """EAGLE-3's layer under --graphs: its two input norms write their halves of the attention's input (no
    concatenation) and the attention's residual add runs in the post-attention norm's kernel: what the same
    kernels give run apart, bit for bit, in two kernels fewer (float16); an `out` that is not rows of x's shape is
    refused."""
    from specbench.heads import eagle, eagle3

    target = random_llama(60, layers=2, seed=0)
    torch.manual_seed(0)
    raw = {**eagle.config_from_target(target.config), "draft_vocab_size": 40}
    head = eagle3.build(raw).to(device, torch.float16).eval()
    layer = fuse_for_graphs(head).midlayer
    embedded, hidden = (torch.randn(1, 5, head.config.hidden_size, device=device).to(torch.float16) for _ in "eh")
    rope = head.rotary(hidden, torch.arange(5, device=device)[None])
    with torch.inference_mode():
        layer(embedded, hidden, rope, None, None)  # (the first call probes the rotation)
        with Ops() as ops:
            got = layer(embedded, hidden, rope, None, None)
        x = torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(hidden)], dim=-1)
        total = hidden + layer.self_attn(x, rope, None, None)[0]
        with Ops() as apart:
            want = total + layer.mlp(layer.post_attention_layernorm(total))
    _same(got, want)
    assert ops.counts["cat"] == 0 and ops.counts["add"] == 1 and apart.counts["add"] == 1  # (the MLP's residual)
    with pytest.raises(ValueError, match="rms_norm writes rows"):
        kernels.rms_norm(hidden, layer.hidden_norm.weight, 1e-6, out=torch.empty_like(hidden)[..., :4])
