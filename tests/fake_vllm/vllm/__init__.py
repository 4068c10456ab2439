"""A stand-in for vLLM's offline API as engine mode uses it, for tests on machines without vLLM: greedy decoding
with the transformers model, a speculative step accepting `ACCEPTED` drafts (vLLM's per-step counts, drafts past a
stop counted as vLLM counts them). It records each engine's arguments in $FAKE_VLLM_LOG (JSON lines), prints as
vLLM does, and fails to build an engine with the message $FAKE_VLLM_FAIL when that is set."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM

from .sampling_params import SamplingParams

__version__ = "0.0-fake"
ACCEPTED = 2  # drafts a speculative step accepts (at most num_speculative_tokens)


@dataclass
class SpecCounts:
    per_step_accepted: list[int]
    per_step_drafted: list[int]


@dataclass
class Completion:
    token_ids: list[int]
    spec_decode_metrics: SpecCounts | None = None


@dataclass
class Output:
    request_id: str
    finished: bool
    outputs: list[Completion]


@dataclass
class _Request:
    ids: list[int]
    params: SamplingParams
    new: list[int] = field(default_factory=list)
    counts: SpecCounts = field(default_factory=lambda: SpecCounts([], []))


class _Engine:
    def __init__(self, model, spec: dict | None) -> None:
        self.model, self.spec, self.live = model, spec, {}

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams) -> None:
        self.live[request_id] = _Request(list(prompt["prompt_token_ids"]), params)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    @torch.inference_mode()
    def _next(self, ids: list[int]) -> int:
        return int(self.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())

    def step(self) -> list[Output]:
        outputs = []
        for request_id, r in list(self.live.items()):
            drafted = self.spec["num_speculative_tokens"] if self.spec and r.new else 0  # the prefill drafts nothing
            accepted = min(ACCEPTED, drafted)
            if drafted:
                r.counts.per_step_accepted.append(accepted)
                r.counts.per_step_drafted.append(drafted)
            fresh = []
            for _ in range(accepted + 1):
                token = self._next(r.ids + r.new + fresh)
                fresh.append(token)
                if token in (r.params.stop_token_ids or []) or len(r.new) + len(fresh) >= r.params.max_tokens:
                    break
            r.new += fresh
            finished = fresh[-1] in (r.params.stop_token_ids or []) or len(r.new) >= r.params.max_tokens
            if finished:
                del self.live[request_id]
            outputs.append(Output(request_id, finished, [Completion(fresh, r.counts if self.spec else None)]))
        return outputs


class LLM:
    def __init__(
        self,
        model: str,
        tokenizer: str,
        dtype: str,
        seed: int,
        trust_remote_code: bool,
        enforce_eager: bool,
        speculative_config: dict | None = None,
        per_request_spec_decode_metrics: str | None = None,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        print(f"INFO fake vLLM: building an engine for {model}")  # as vLLM, hundreds of lines a run
        print("WARNING fake vLLM: a notice nobody asked for", file=sys.stderr)
        if os.environ.get("FAKE_VLLM_FAIL"):
            print(f"ERROR fake vLLM: {os.environ['FAKE_VLLM_FAIL']}", file=sys.stderr)
            raise RuntimeError(os.environ["FAKE_VLLM_FAIL"])
        if os.environ.get("FAKE_VLLM_LOG"):
            with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
                f.write(
                    json.dumps(
                        {
                            "model": model,
                            "dtype": dtype,
                            "speculative_config": speculative_config,
                            "metrics": per_request_spec_decode_metrics,
                        }
                    )
                    + "\n"
                )
        net = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        self.llm_engine = _Engine(net, speculative_config)
