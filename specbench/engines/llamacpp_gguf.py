"""Checkpoints as GGUF for llama-server: a Hugging Face folder (target, draft model) or a head in our layout
(EAGLE-3, DFlash; converted against its target's folder), run through the pinned tree's own converter and cached
by content, so a changed checkpoint converts again and an unchanged one never does.

The converter names a tokenizer's pre-tokenizer by hashing what it makes of a test text, and refuses a hash it does
not list. The tiny family's tokenizer (ours) splits exactly as GPT-2 does (byte-level BPE with GPT-2's regex), so a
tokenizer with that pre-tokenizer and an unlisted hash is named "gpt-2"; any other unlisted one is still refused.
Run as `python -m specbench.engines.llamacpp_gguf CONVERTER ARGS...` it is that converter with this one fallback."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from ..errors import SpecbenchError
from . import llamacpp_build

OUTTYPE = "f32"  # our checkpoints keep their values exactly (the suite's own runs are float32 on a CPU)


def _digest(folders: list[Path]) -> str:
    """The content of the folders' files (names, sizes and bytes), with the converter's version and out type."""
    digest = hashlib.sha256(f"{llamacpp_build.VERSION}/{OUTTYPE}".encode())
    for folder in folders:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(f"{path.relative_to(folder)}:{path.stat().st_size}".encode())
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def convert(folder: Path, target: Path | None = None) -> Path:
    """`folder` as one GGUF file in the cache (converted once per content). `target`: the folder of the model a
    head drafts for (its tokenizer and layer metadata; llama.cpp's `--target-model-dir`)."""
    if not (folder / "config.json").is_file():
        raise SpecbenchError(f"'{folder}' has no config.json: cannot convert it to GGUF")
    folders = [folder] + ([target] if target else [])
    out = llamacpp_build.home() / "gguf" / f"{folder.name}-{_digest(folders)[:16]}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")
    command = [sys.executable, "-m", __name__, str(llamacpp_build.converter()), str(folder)]
    command += ["--outtype", OUTTYPE, "--outfile", str(part)] + (["--target-model-dir", str(target)] if target else [])
    print(f"converting {folder} to GGUF with llama.cpp's converter (once): {out}", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        part.unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecbenchError(f"llama.cpp's converter could not convert '{folder}' to GGUF: {last}")
    part.rename(out)
    return out


def gpt2_split(folder: Path) -> bool:
    """Whether a tokenizer.json pre-tokenizes as GPT-2: byte-level with GPT-2's regex, nothing before it."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return False
    pre = json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def _main(converter: Path, argv: list[str]) -> None:
    """The converter's own main, with unlisted GPT-2-split tokenizers named "gpt-2"."""
    sys.path.insert(0, str(converter.parent))
    sys.argv = [str(converter), *argv]
    from conversion.base import TextModel  # the converter's package, beside it in the pinned tree

    listed = TextModel.get_vocab_base_pre

    def named(self, tokenizer) -> str:
        try:
            return listed(self, tokenizer)
        except NotImplementedError:
            if gpt2_split(Path(self.dir_model)):
                return "gpt-2"
            raise

    TextModel.get_vocab_base_pre = named
    import convert_hf_to_gguf

    convert_hf_to_gguf.main()


if __name__ == "__main__":
    _main(Path(sys.argv[1]), sys.argv[2:])
