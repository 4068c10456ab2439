"""Loading targets, drafts and tokenizers from a local folder in the run's device and dtype."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch

from ..errors import SpecbenchError
from . import placement
from .aliases import TINY_DIR
from .decoder import Decoder, unsupported
from .few_rows import use_few_row_layout


def pick_device(device: str) -> torch.device:
    placement.check_device(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecbenchError(f"--device {device} asked for, but no CUDA device is available: use --device cpu")
    return dev


DTYPES = {name: getattr(torch, name) for name in placement.DTYPES}


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    placement.check_dtype(dtype)
    return DTYPES[dtype]


def device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """--device and --dtype resolved, the one place it happens: "auto" is CUDA in float16 where there is one, else
    the CPU in float32; a bad value is one line."""
    chosen = pick_device(device)
    return chosen, pick_dtype(dtype, chosen)


def check_bundled(path: str, what: str) -> None:
    """A missing part of the bundled tiny family says how to build it."""
    if path.startswith(str(TINY_DIR)) and not Path(path).is_dir():
        raise SpecbenchError(f"the bundled tiny {what} is missing at {path}: build it with `specbench zoo build`")


def load_causal_lm(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    what: str = "model",
    trust_remote_code: bool = False,
):
    """A causal LM from a local folder (a run fetches hub checkpoints first) or a hub id (training commands)."""
    from transformers import AutoModelForCausalLM

    check_bundled(str(path), what)
    print(f"loading {what}: {path} ({str(dtype).removeprefix('torch.')} on {device})", file=sys.stderr, flush=True)
    try:
        with _bars_on_a_terminal_only():
            model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code
            )
    except (OSError, ValueError) as err:
        raise SpecbenchError(f"could not load {what} '{path}': {str(err).splitlines()[0]}") from err
    if device.type == "cuda":
        # cuDNN's attention builds a new execution plan for every key length it has not seen, several ms a
        # layer at each decode step (measured on an H100, torch 2.11): keep SDPA on flash/memory-efficient.
        torch.backends.cuda.enable_cudnn_sdp(False)
    return use_few_row_layout(model.to(device).eval())


@contextmanager
def _bars_on_a_terminal_only() -> Iterator[None]:
    """transformers' "Loading weights" bar, unlabelled, is a wall of carriage returns in a log file: off a terminal
    it is silenced while a model loads (the line before names what loads)."""
    from transformers.utils import logging as hf_logging

    quiet = not sys.stderr.isatty() and hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet:
            hf_logging.enable_progress_bar()


def owned_decoder(model: torch.nn.Module, what: str) -> Decoder | None:
    """What `--graphs` runs `model` on: our decoder on its weights (`models.decoder`), or None for an architecture
    outside the Llama family, which then runs eagerly on transformers (said in one line here, and in the manifest)."""
    why = unsupported(model)
    if why is not None:
        print(f"--graphs: the {what} runs eagerly on transformers, as {why}", file=sys.stderr)
        return None
    return use_few_row_layout(Decoder.adopt(model))


T = TypeVar("T")
RECOMPILE_LIMIT = 64  # graphs per function: one token, a chain, a tree with its mask, a prefill, ... (default 8)


def compile_function(fn: Callable[..., T]) -> Callable[..., T]:
    """`--compile`: `fn` through torch.compile with dynamic shapes (one graph for every sequence and tree length
    and key span; the first calls compile, which a run's warm-up absorbs)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=True)


def compile_forward(module: torch.nn.Module, graphs: bool = False) -> torch.nn.Module:
    """`--compile`: the module's forward through `compile_function`. For a causal LM, its decoder stack: the
    lm_head stays eager, as the loop reads logits row by row. With `graphs` on a GPU, whose forwards are captured
    once and replayed, each decoder layer apart (`compile_layers`); uncaptured, a call per layer would pay its
    guards and wrappers at every forward, so the stack stays one graph (docs/cpu-notes.md)."""
    owner = module.get_decoder() if hasattr(module, "get_decoder") else module  # type: ignore[operator]
    layers = getattr(owner, "layers", None)
    first = next(module.parameters(), None)
    if graphs and first is not None and first.device.type == "cuda" and isinstance(layers, torch.nn.ModuleList):
        compile_layers(layers)
    else:
        owner.forward = compile_function(owner.forward)
    return module


def compile_layers(layers: torch.nn.ModuleList) -> None:
    """Each layer's forward through `compile_function`, the layer's number a symbol (`StaticRows` writes every
    layer's rows into one tensor at an offset), so all layers share one graph: compiling does not grow with depth,
    as a graph of the whole stack's does (it traces every layer)."""
    for layer in layers:
        shared = torch._dynamo.patch_dynamo_config(allow_unspec_int_on_nn_module=True)  # (while tracing only)
        layer.forward = compile_function(shared(layer.forward))


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    check_bundled(str(path), "tokenizer")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise SpecbenchError(f"could not load the tokenizer of '{path}': {str(err).splitlines()[0]}") from err


def same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id


def stop_ids(tokenizer, generation_config) -> set[int]:
    """Token ids that end a turn: the tokenizer's EOS and the generation config's EOS ids (None: no config)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    return ids
