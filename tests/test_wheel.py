"""What `pip install specbench` carries: the tiny family (target, draft, every head), the presets and the tasks, so the
default `specbench run` works from the wheel alone; the SmolLM2 heads stay in the source tree (docs/development.md
says where they come from otherwise). The wheel is built here and run from a folder of its own, not the checkout."""

import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
MOST_BYTES = 80 << 20  # the wheel, compressed (the tiny family's weights are most of it: 70 MB when this was written)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("hatchling", reason="building the wheel needs hatchling (the dev extra installs it)")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
    )
    return next(out.glob("specbench-*.whl"))


def test_the_wheel_carries_the_tiny_family_and_the_presets_not_the_smollm2_heads(wheel):
    assert wheel.stat().st_size <= MOST_BYTES
    names = set(zipfile.ZipFile(wheel).namelist())
    for part in ("target", "draft", "medusa", "eagle", "eagle3", "mtp", "dflash", "pard"):
        assert any(n.startswith(f"specbench/zoo/tiny/{part}/") and n.endswith(".safetensors") for n in names), part
    assert "specbench/_presets/methods/vanilla.yaml" in names and "specbench/_presets/tasks/quick.yaml" in names
    assert not [n for n in names if n.startswith("specbench/zoo/smollm2/") and not n.endswith("MODEL_CARD.md")]
    assert not [n for n in names if n.startswith("tests/") or "__pycache__" in n]


def test_the_default_run_works_from_the_wheel_alone(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": str(site)}  # (ahead of the checkout's editable install)
    where = subprocess.run(
        [sys.executable, "-c", "import specbench; print(specbench.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.strip().startswith(str(site))
    run = shlex.split(
        "run --limit 1 --tasks quick --methods vanilla,pld --max-new-tokens 4 --no-noise-floor --no-warmup"
    )
    run += ["--out", str(tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, "-m", "specbench.cli", *run], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "report" / "report.md").is_file()
