"""The measurements of scripts/gpu_check.sh that are not a `specbench run`.

python scripts/gpu_check.py roofline --weights DIR/target --out roofline.json
    warms the GPU to a steady clock, then measures a device copy's bandwidth and the weights' bytes: the
    tokens/s a one-token decode could reach if it only streamed the weights (the bandwidth roofline)
python scripts/gpu_check.py summary RUN --roofline roofline.json
    the table a closing note quotes: roofline, T(n) of the target's forward, each method's tokens/s, τ and step
    cost split into target forward, drafting and the rest (host: Python, launches, sampling), the A/A floor
python scripts/gpu_check.py drafting [--like vicuna-7b] [--method eagle2|eagle3] [--profile FILE]
    one EAGLE-2/3 draft step at the model's real shapes (random head, a 256-token prompt, two pairs committed a
    step), timed on the eager cache, on --graphs' static cache uncaptured, and captured; with --profile, each
    regime's kernels by device time (torch.profiler) written to FILE
python scripts/gpu_check.py products [--like vicuna-7b] [--layers N]
    the one-row matrix products of a one-token forward alone (every layer's projections and the readout, random
    weights), captured as one graph and replayed: their time against the copy bandwidth, with q/k/v and gate/up
    as separate products (transformers' layout) and concatenated (fused, as vLLM and gpt-fast load them), on
    cuBLAS and on cuBLASLt: how far the products themselves are from the roofline
python scripts/gpu_check.py forward [--like vicuna-7b] [--variants loop,compiled] [--profile FILE]
    T(n) of the target's --graphs forward (random weights built in memory), as the loop runs it (the owned
    decoder, models.decoder: q/k/v and gate/up each one product, norms and rotary as torch's ops) and with each
    variant: captured attention on the memory-efficient kernel instead of cuDNN's (efficient), or the decoder
    layers compiled as `run --graphs --compile` does (compiled: attention and the cache's
    writes too, the key span a symbol; compiled-stack: the whole stack as one graph; compiled-static: the stack
    with a graph per shape, which shows what dynamic shapes cost; compiled-math: attention as two batched
    products and a fused softmax instead of the memory-efficient kernel; compiled-autotune: inductor timing its
    own matrix kernels against cuBLAS's, as gpt-fast compiles; cublaslt: the loop on cuBLASLt's kernels, which
    shows how far the one-row products' library is from the bandwidth); with --profile, each variant's
    kernels in one-token forwards by device time, written to FILE (where a forward that streams 3.2 ms of
    weights spends the rest: matrix-vector products short of the bandwidth, or small kernels)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from pathlib import Path

import torch

from specbench.machine import gpu_clocks, warm_gpu
from specbench.report import batches, cells, frames, metrics, regimes, sources

COPY_BYTES = 2 << 30


def copy_bandwidth(device: torch.device, repeats: int = 20) -> float:
    """Bytes read plus written per second by a device-to-device copy of COPY_BYTES (the median of `repeats`)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return 2 * COPY_BYTES / sorted(times)[len(times) // 2]


def weight_bytes(folder: Path) -> int:
    """Bytes of the model's weights as stored (what a one-token forward reads once)."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def roofline(args) -> None:
    device = torch.device("cuda")
    before = gpu_clocks(device)
    warm_gpu(device)
    bandwidth = copy_bandwidth(device)
    weights = weight_bytes(args.weights)
    result = {
        "device": torch.cuda.get_device_name(device),
        "copy_bytes_per_s": bandwidth,
        "weight_bytes": weights,
        "roofline_tokens_per_s": bandwidth / weights,
        "clocks_idle": before,
        "clocks_warm": gpu_clocks(device),
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def summary(args) -> None:
    roof = json.loads(args.roofline.read_text())
    turns = frames.frame([args.run])
    batched = turns[(turns.temperature == 0) & (turns.batch_size > 1)]
    turns = turns[(turns.temperature == 0) & (turns.batch_size == 1)]
    profile = {int(k): v for k, v in json.loads((args.run / "forward_profile.json").read_text()).items()}
    limit = roof["roofline_tokens_per_s"]
    manifest = json.loads((args.run / "manifest.json").read_text())
    config, forced = manifest["config"], manifest.get("synthetic")
    regime = " ".join(flag for flag in ("--graphs", "--compile") if config.get(flag[2:])) or "eager"
    if forced:  # `run --acceptance synthetic:...`: verdicts forced, tokens not the model's
        regime += ", cost-only at synthetic acceptance " + ",".join(f"{r:g}" for r in forced["rates"])
    print(f"### {roof['device']}: {args.run.name} ({regime})\n")
    copy, weights = roof["copy_bytes_per_s"] / 1e12, roof["weight_bytes"] / 1e9
    print(
        f"Device copy {copy:.2f} TB/s (read + written) ÷ {weights:.2f} GB of target weights = bandwidth roofline "
        f"{limit:.0f} tokens/s. SM clock idle / warm: "
        f"{(roof['clocks_idle'] or {}).get('sm_mhz')} / {(roof['clocks_warm'] or {}).get('sm_mhz')} MHz.\n"
    )
    print(
        "T(n), the target's forward over n new tokens after 256 cached (ms): "
        + ", ".join(f"T({n}) {_ms(t)}" for n, t in sorted(profile.items()))
        + "\n"
    )
    base = turns[turns.method == "vanilla"]
    steps = frames.steps_frame([args.run])
    steps = steps[(steps.temperature == 0) & (steps.batch_size == 1)]
    rows = [
        "| method | tokens/s | share of roofline | speedup [95% CI] | τ | ms/step (× vanilla's) | target forward "
        "(rows) | drafting | rest (host) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = ["vanilla", "vanilla-aa", *sorted(set(turns.method) - {"vanilla", "vanilla-aa"})]
    vanilla_step = regimes.step_split(base)[0]
    for method in [m for m in order if m in set(turns.method)]:
        own = turns[turns.method == method]
        step, verify, draft, rest = regimes.step_split(own)
        rate = own.new_tokens.sum() / own.wall_time.sum()
        s = metrics.paired_speedup(own, base) if method != "vanilla" else None
        speedup = metrics.format_ratio(s.value, s.low, s.high) if s else "1.00×"
        verified = cells.mean_tree_size(steps[steps.method == method])
        rows.append(
            f"| {method} | {rate:.1f} | {rate / limit:.0%} | {speedup} | {metrics.tau(own):.2f} | "
            f"{_ms(step)} ({step / vanilla_step:.2f}×) | {_ms(verify)} ({verified:.0f}) | {_ms(draft)} | "
            f"{_ms(rest)} |"
        )
    print("\n".join(rows))
    aa = turns[turns.method == "vanilla-aa"]
    if not aa.empty:
        s = metrics.paired_speedup(aa, base)
        verdict = "contains 1.00" if s.low <= 1 <= s.high else "does NOT contain 1.00: the timings did not hold still"
        print(f"\nA/A floor (vanilla timed twice): {metrics.format_ratio(s.value, s.low, s.high)}, {verdict}.")
    if not batched.empty:
        _batch_summary(args.run, limit)


def _batch_summary(run: Path, limit: float) -> None:
    """The run's batch sweep (`run --batch`): per method and B, total and per-user tokens/s, the speedup over vanilla
    at the same B, τ, and vanilla's total against its own at B = 1 (the throughput batching buys)."""
    for group in batches.groups(cells.collect_cells(sources.load_sources([run]))):
        if group[0].temperature != 0:
            continue
        data = batches.rows(group)
        one = data[(data.method == "vanilla") & (data.batch == 1)].total
        print(f"\nBatch sweep ({group[0].task}; total tokens/s over the roofline's {limit:.0f} one-sequence rate):\n")
        header = (
            "| method | B | total tokens/s | per-user tokens/s | speedup at the same B [95% CI] | τ | total ÷ B=1's |"
        )
        print(header)
        print("|---|---|---|---|---|---|---|")
        for r in data.sort_values(["method", "batch"]).itertuples():
            speedup = (
                "1.00×" if r.speedup is None else metrics.format_ratio(r.speedup.value, r.speedup.low, r.speedup.high)
            )
            gain = f"{r.total / one.iloc[0]:.1f}×" if len(one) else "—"
            print(f"| {r.method} | {r.batch} | {r.total:.1f} | {r.per_user:.1f} | {speedup} | {r.tau:.2f} | {gain} |")


def _draft_steps(proposer, tokens: list[int], vocab: int, count: int = 1) -> list[int]:
    """`count` steps of a propose, then one draft accepted and the target's token committed (two pairs, random
    features); returns the tokens after them."""
    from specbench.core.proposer import Feedback

    for _ in range(count):
        proposer.propose(tokens, 100)
        tokens = tokens + torch.randint(vocab, (2,)).tolist()
        features = torch.randn(
            2, proposer.head.feature_size, device=proposer.device, dtype=proposer.head.fc.weight.dtype
        )
        proposer.update(tokens, None, Feedback(None, features))
    return tokens


def drafting(args) -> None:
    from random_checkpoints import EAGLE3_DRAFT_VOCAB, SHAPES, _config

    from specbench.core.proposer import Turn
    from specbench.heads import eagle, eagle3
    from specbench.methods.eagle import Eagle, StaticDrafting
    from specbench.methods.eagle_trees import DynamicTree
    from specbench.models.aliases import TINY_DIR

    device = torch.device(args.device)
    if device.type == "cuda":  # the attention kernels the run uses (models.loading.load_causal_lm)
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    config = _config(SHAPES[args.like]["target"], TINY_DIR / "target")
    raw, vocab = eagle.config_from_target(config), config.vocab_size

    def built():
        """The random head (the same each time; on the owned decoder's modules, as every regime drafts) and the
        proposer's options."""
        torch.manual_seed(0)
        with torch.device(device):
            if args.method == "eagle2":
                head = eagle.build(raw)
                readout = torch.nn.Linear(config.hidden_size, vocab, bias=False).to(dtype)
                options = dict(lm_head=readout, expansion=DynamicTree(60, 5, 10))
            else:
                head = eagle3.build({**raw, "draft_vocab_size": min(EAGLE3_DRAFT_VOCAB, vocab)})
                if head.d2t is not None:
                    head.d2t, head.t2d = eagle3.vocabulary_maps(torch.arange(EAGLE3_DRAFT_VOCAB, device=device), vocab)
                options = dict(
                    lm_head=head.logits,
                    expansion=DynamicTree(60, 7, 10),
                    target_ids=head.target_ids,
                    target_vocab=vocab,
                )
        return head.to(dtype).eval(), options

    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    tables = []
    print(f"| {args.method} at {args.like}'s shapes, {dtype} | ms per draft step (median of {args.steps}) |")
    print("|---|---|")
    for regime in args.regimes.split(","):
        if regime not in ("eager", "static", "captured", "compiled"):
            raise SystemExit(f"unknown regime '{regime}': use eager, static, captured or compiled")
        head, options = built()
        static = functools.partial(StaticDrafting, compile=regime == "compiled")
        proposer = Eagle(head, drafting=None if regime == "eager" else static, **options)
        if regime == "static":
            proposer.static.replays.capture = False
        tokens = torch.randint(vocab, (args.prompt,)).tolist()
        proposer.start(
            Turn(tokens, 0.0, None, torch.randn(len(tokens) - 1, head.feature_size, device=device, dtype=dtype))
        )
        times = []
        for _ in range(args.steps + 3):  # the first steps feed the prompt and capture
            sync()
            start = time.perf_counter()
            tokens = _draft_steps(proposer, tokens, vocab)
            sync()
            times.append(time.perf_counter() - start)
        if args.profile:
            steps = _kernels(device, _draft_steps, proposer, tokens, vocab, 5)
            tables.append(f"## {regime} (5 steps)\n\n{steps}")
        print(f"| {regime} | {_ms(sorted(times[3:])[len(times[3:]) // 2])} |")
    if args.profile:
        args.profile.write_text("\n".join(tables))


def forward(args) -> None:
    from random_checkpoints import SHAPES, _config
    from torch.nn.attention import SDPBackend
    from transformers import LlamaForCausalLM

    from specbench.core.static_lm import BatchedLM
    from specbench.models.aliases import TINY_DIR
    from specbench.models.decoder import Decoder
    from specbench.models.loading import compile_forward, compile_layers
    from specbench.run.worker import forward_profile

    device = torch.device(args.device)
    if device.type == "cuda":  # the attention kernels the run uses (models.loading.load_causal_lm)
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    shape = {**SHAPES[args.like]["target"], **({"num_hidden_layers": args.layers} if args.layers else {})}
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(_config(shape, TINY_DIR / "target"), dtype=dtype).eval()
    owned = Decoder.adopt(model)  # what `run --graphs` runs
    sizes = (1, 8, 64)
    print(
        f"| {args.like} ({shape['num_hidden_layers']} layers), {dtype}, --graphs forward after 256 cached | "
        + " | ".join(f"T({n}) ms" for n in sizes)
        + " | seconds in all (compiling included) |"
    )
    print("|---|" + "---|" * (len(sizes) + 1))
    tables = []
    for variant in args.variants.split(","):
        around = contextlib.nullcontext()  # what the variant's timing runs inside
        layers = owned.layers
        if variant == "compiled":  # `run --graphs --compile`: each decoder layer (attention and the cache's
            compile_layers(layers)  # writes included), one graph all layers share
        elif variant == "compiled-stack":  # the whole decoder stack as one graph (fuses across layers; compiling
            compile_forward(owned)  # traces every layer)
        elif variant == "compiled-static":  # the stack with static shapes: a graph per rows bucket and key span (what
            owned.forward = torch.compile(owned.forward, dynamic=False)  # dynamic shapes may cost)
        elif variant == "compiled-math":  # compiled, attention traced as SDPA's math (two batched products and a
            compile_layers(layers)  # softmax that inductor fuses) instead of the memory-efficient
            around = _captured_attention([SDPBackend.MATH])  # kernel, which one query row leaves mostly idle
        elif variant == "compiled-autotune":  # compiled as gpt-fast does: inductor times its own matrix kernels
            compile_layers(layers)  # against cuBLAS's for each product (a one-row product is a matrix-vector one)
            around = torch._inductor.config.patch(max_autotune_gemm=True, coordinate_descent_tuning=True)
        elif variant == "efficient":  # captured attention on the memory-efficient kernel rather than cuDNN's
            around = _captured_attention([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
        elif variant == "cublaslt":  # the loop with cuBLASLt's matrix kernels instead of cuBLAS's
            around = _blas("cublaslt")
        elif variant != "loop":
            raise SystemExit(
                f"unknown variant '{variant}': use loop, efficient, compiled, compiled-stack, "
                "compiled-static, compiled-math, compiled-autotune or cublaslt"
            )
        try:
            start = time.perf_counter()
            with around:
                lm = BatchedLM(owned)
                profile = forward_profile(lm, sizes=sizes)
                took = time.perf_counter() - start
                if args.profile:
                    tables.append(
                        f"## {variant}, 10 one-token forwards after 256 cached\n\n"
                        f"{_kernels(device, _one_token_forwards, lm, 10)}"
                    )
            print(f"| {variant} | " + " | ".join(_ms(profile[n]) for n in sizes) + f" | {took:.0f} |")
        finally:
            for module in (owned, *layers):
                module.__dict__.pop("forward", None)
            torch._dynamo.reset()  # the next variant compiles afresh, never reusing this one's graphs
    if args.profile:
        args.profile.write_text("\n".join(tables))


def _layer_products(shape: dict, fused: bool) -> list[tuple[int, int]]:
    """(outputs, inputs) of one decoder layer's products; `fused`: q/k/v as one, gate/up as one."""
    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    kv = hidden * shape.get("num_key_value_heads", shape["num_attention_heads"]) // shape["num_attention_heads"]
    attention = [(hidden + 2 * kv, hidden)] if fused else [(hidden, hidden), (kv, hidden), (kv, hidden)]
    mlp = [(2 * inner, hidden)] if fused else [(inner, hidden), (inner, hidden)]
    return [*attention, (hidden, hidden), *mlp, (hidden, inner)]


def products(args) -> None:
    from random_checkpoints import SHAPES

    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.like]["target"]
    layers = args.layers or shape["num_hidden_layers"]
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    print(
        f"| {args.like}'s products ({layers} layers and the readout), one row, {dtype} | library | ms | GB | "
        "TB/s | share of the copy bandwidth |\n|---|---|---|---|---|---|"
    )
    for fused in (False, True):
        sizes = [*_layer_products(shape, fused) * layers, (shape["vocab_size"], shape["hidden_size"])]
        weights = [torch.randn(rows, cols, device=device, dtype=dtype) for rows, cols in sizes]
        inputs = {cols: torch.randn(1, cols, device=device, dtype=dtype) for _, cols in sizes}
        gigabytes = sum(w.numel() * w.element_size() for w in weights) / 1e9

        def run(weights=weights, inputs=inputs) -> list[torch.Tensor]:
            return [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights]

        for library in ("cublas", "cublaslt") if device.type == "cuda" else ("cpu",):
            with _blas(library) if device.type == "cuda" else contextlib.nullcontext():
                seconds = _replayed(run, device)
            rate = gigabytes / seconds / 1e3
            share = f"{rate * 1e12 / bandwidth:.0%}" if bandwidth else "-"
            layout = "q/k/v, gate/up fused" if fused else "separate (transformers')"
            print(f"| {layout} | {library} | {_ms(seconds)} | {gigabytes:.2f} | {rate:.2f} | {share} |")
        del weights


def _replayed(run, device: torch.device, repeats: int = 20) -> float:
    """Median seconds of `run()`, captured as one CUDA graph and replayed on a GPU (called directly elsewhere)."""
    if device.type == "cuda":
        from specbench.core.capture import capture

        graph, _ = capture(run, device)
        run = graph.replay
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    run()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


@contextlib.contextmanager
def _captured_attention(backends: list):
    """Captured forwards' attention on `backends` (by priority) while the block runs (core.capture)."""
    from specbench.core import capture

    kept, capture.CAPTURED_ATTENTION = capture.CAPTURED_ATTENTION, backends
    try:
        yield
    finally:
        capture.CAPTURED_ATTENTION = kept


@contextlib.contextmanager
def _blas(library: str):
    """torch's preferred BLAS library on CUDA set to `library` while the block runs."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _one_token_forwards(lm, count: int, context: int = 256) -> None:
    """`count` one-token forwards of slot 0 of `lm` (a BatchedLM) after `context` cached tokens (the prefill before
    the first is the caller's if the cache already holds `context` rows; each forward's row is dropped again)."""
    from specbench.core.static_lm import Row

    if lm.lengths[0] != context:
        lm.prefill([0], [list(range(context + 1))])
    for _ in range(count):
        lm.verify([Row(0, [context])])
        lm.rewind(0, context)


def _kernels(device: torch.device, run, *args) -> str:
    """What `run(*args)` launched, by self device time (CPU time off a GPU), with the number of calls:
    torch.profiler's table."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run(*args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return f"{prof.key_averages().table(sort_by=key, row_limit=30)}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description="gpu_check.sh's roofline and summary table")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("roofline")
    r.add_argument("--weights", type=Path, required=True, help="the target's folder")
    r.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("summary")
    s.add_argument("run", type=Path)
    s.add_argument("--roofline", type=Path, required=True)
    d = sub.add_parser("drafting")
    d.add_argument("--like", default="vicuna-7b")
    d.add_argument("--method", choices=["eagle2", "eagle3"], default="eagle2")
    d.add_argument("--device", default="cuda")
    d.add_argument("--prompt", type=int, default=256)
    d.add_argument("--steps", type=int, default=30)
    d.add_argument("--profile", type=Path)
    d.add_argument(
        "--regimes",
        default="eager,static,captured,compiled",
        help="eager cache (transformers' layers); static cache uncaptured; captured; captured after "
        "torch.compile (the last three on the owned decoder's layers)",
    )
    p = sub.add_parser("products")
    p.add_argument("--like", default="vicuna-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, help="fewer layers than the model's (a rehearsal on a CPU)")
    f = sub.add_parser("forward")
    f.add_argument("--like", default="vicuna-7b")
    f.add_argument("--device", default="cuda")
    f.add_argument("--layers", type=int, help="fewer layers than the model's (a rehearsal on a CPU)")
    f.add_argument("--profile", type=Path, help="write each variant's kernels by device time here")
    f.add_argument("--variants", default="loop,compiled,compiled-stack,compiled-static,compiled-math")
    args = parser.parse_args()
    {"roofline": roofline, "summary": summary, "drafting": drafting, "forward": forward, "products": products}[
        args.command
    ](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
