"""A run's settings and its loaded target: the plan worked out, checkpoints fetched, the target loaded with its
tokenizer, and one question answered turn by turn with a method's proposer."""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import methods, tasks
from ..core import acceptance
from ..core.cached_lm import CachedLM
from ..core.decode import Generation, decode
from ..errors import SpecbenchError
from ..models import loading
from ..models.chat import prompt_ids
from . import plan as planning
from . import tuned


@dataclass
class RunConfig:
    model: str = "tiny"
    methods: list[str] = field(default_factory=lambda: ["default"])  # names, variants, "all" or "default"
    tasks: list[str] = field(default_factory=lambda: ["quick"])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    limit: int | None = None  # questions per category
    max_new_tokens: int | None = None  # None: each task's own default
    device: str = "auto"
    dtype: str = "auto"
    out: str | None = None
    data_dir: str | None = None
    seed: int = 0
    draft: str | None = None
    heads: dict[str, str] = field(default_factory=dict)  # method family (or "*") -> head checkpoint (--head)
    revision: str | None = None  # of a hub target given by id (aliases pin their own)
    trust_remote_code: bool = False
    fields: dict[str, str] = field(default_factory=dict)
    warmup: bool = True
    progress: bool = True
    noise_floor: bool = True  # time vanilla twice per question (the A/A column) to report the run's noise
    repeats: int = 1  # timings per question and method; the median one is kept
    shard: list[int] | None = None  # [I, N]: only every N-th question from the I-th (1-based), for array jobs
    workers: int | None = None  # Ray workers of one device each; None: this process alone, without Ray
    ray_address: str | None = None  # an existing Ray cluster to join (None: start a local one)
    threads: int | None = None  # torch CPU threads per worker (None: torch's default alone, cores / workers on Ray)
    tuned: str | None = None  # a tuned-presets file (--tuned): each tuned method's chosen variant runs beside it
    compile: bool = False  # torch.compile the target, draft and heads (--compile); vLLM's compilation in engine mode
    engine: str = "specbench"  # "vllm": engine mode, the questions answered inside vLLM (engine_vllm)
    concurrency: list[int] | None = None  # engine mode: conversations in flight, one sweep per level
    one_engine_at_a_time: bool = False  # engine mode: methods one after another instead of every engine at once


def question_seed(base: int, question_id: int | str, temperature: float) -> int:
    """A seed per question (and temperature), stable across methods and runs."""
    return zlib.crc32(f"{base}/{question_id}/{temperature}".encode())


def prepare(cfg: RunConfig) -> planning.Plan:
    """The run's plan (nothing loaded yet); skipped methods are announced one line each."""
    device = torch.device("cpu") if cfg.workers else loading.pick_device(cfg.device)  # Ray: the workers' devices
    dtype = loading.pick_dtype(cfg.dtype, device)  # a bad --device/--dtype fails first
    plan = planning.make(cfg)
    for name, why in plan.skipped.items():
        print(f"{name} skipped: {why}", file=sys.stderr)
    if cfg.tuned:
        key = tuned.device_key(device, cfg.threads)
        entries = tuned.lookup(Path(cfg.tuned), key, plan.spec.name, str(dtype).removeprefix("torch."))
        plan.methods, used = tuned.with_tuned(plan.methods, entries)
        plan.tuned = {m: {**entries[m], "file": str(cfg.tuned), "device": key} for m in used}
        for name in [m for m in plan.methods if m not in entries and m != "vanilla" and m not in used.values()]:
            print(f"{name}: not tuned for {plan.spec.name} on this device; its default runs alone", file=sys.stderr)
    return plan


class Session:
    """A loaded target model with its tokenizer, ready to run methods over questions."""

    def __init__(self, cfg: RunConfig, plan: planning.Plan, paths: dict[str, Path]) -> None:
        self.cfg = cfg
        self.spec = plan.spec
        self.plan = plan
        self.paths = paths
        self.device = loading.pick_device(cfg.device)
        self.dtype = loading.pick_dtype(cfg.dtype, self.device)
        self.tokenizer = loading.load_tokenizer(paths["target"], cfg.trust_remote_code)
        self.model = loading.load_causal_lm(paths["target"], self.device, self.dtype, "target", cfg.trust_remote_code)
        if cfg.compile:
            loading.compile_forward(self.model)
        self.target = CachedLM(self.model)
        self.stop_ids = loading.stop_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        self.rules: dict[str, acceptance.Rule] = {}  # method -> its acceptance rule, read from its preset once
        self.resources = methods.Resources(
            self.spec.name,
            self.model,
            self.tokenizer,
            self.device,
            self.dtype,
            draft_path=paths.get("draft"),
            head_paths={role.removesuffix(" head"): p for role, p in paths.items() if role.endswith(" head")},
            trust_remote_code=cfg.trust_remote_code,
            compile=cfg.compile,
        )

    @classmethod
    def open(cls, cfg: RunConfig) -> Session:
        """Plan, fetch and check every checkpoint, then load the target: mistakes surface before it loads."""
        plan = prepare(cfg)
        return cls(cfg, plan, planning.fetch(plan, cfg.trust_remote_code))

    def check_fits(self, question: tasks.Question, messages: list[dict[str, str]]) -> list[int]:
        """The prompt ids for `messages`, or a clear error when they leave no room in the model's context."""
        ids = prompt_ids(self.tokenizer, messages)
        if len(ids) >= self.target.context_length:
            raise SpecbenchError(
                f"question {question.id}: its prompt has {len(ids)} tokens, more than the model's context of "
                f"{self.target.context_length}; drop it from the task or use a model with a longer context"
            )
        return ids

    def answer(
        self,
        method: str,
        proposer,
        question: tasks.Question,
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ):
        """Decode every turn with the method's proposer and acceptance rule, feeding the model's own earlier
        answers back. Returns generations, prompts and texts."""
        if method not in self.rules:
            self.rules[method] = methods.rule(method)
        rule = self.rules[method]
        generator = torch.Generator(self.device).manual_seed(seed)
        messages: list[dict[str, str]] = []
        gens: list[Generation] = []
        prompts: list[list[int]] = []
        texts: list[str] = []
        for number, turn in enumerate(question.turns):
            messages.append({"role": "user", "content": turn})
            ids = self.check_fits(question, messages)
            gen = decode(
                self.target,
                proposer,
                ids,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                stop_ids=self.stop_ids,
                generator=generator,
                rule=rule,
                request=((question.group, question.id), number),
            )
            text = self.tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()
            messages.append({"role": "assistant", "content": text})
            gens.append(gen)
            prompts.append(ids)
            texts.append(text)
        return gens, prompts, texts
