"""What `pip install specbench` carries: the tiny family (target, draft, every head), the presets and the tasks, so the
default `specbench run` works from the wheel alone; the SmolLM2 heads go in a wheel of their own,
specbench-smollm2-heads (packages/smollm2-heads, the `smollm2` extra; docs/development.md). The wheels are built here
and run from a folder of their own, not the checkout."""

import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SMOLLM2_HEADS = sorted(p for p in (ROOT / "specbench" / "zoo" / "smollm2").iterdir() if p.is_dir())
MOST_BYTES = 95 << 20  # the wheel, compressed, under PyPI's 100 MB a file (the tiny family's weights are most of it:
# 70 MB when this was written, 92 MB with the P-EAGLE head and DSpark drafter of 2026-11-29)


def build(project: Path, out: Path) -> Path:
    pytest.importorskip("hatchling", reason="building a wheel needs hatchling (the dev extra installs it)")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(project), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
    )
    return next(out.glob("*.whl"))


def install(wheel: Path, site: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    return site


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build(ROOT, tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def heads_wheel(tmp_path_factory) -> Path:
    return build(ROOT / "packages" / "smollm2-heads", tmp_path_factory.mktemp("heads-wheel"))


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    """The wheel alone, installed."""
    return install(wheel, tmp_path_factory.mktemp("site"))


def away(site: Path, *more: Path) -> dict[str, str]:
    """The environment of a process that imports specbench from `site` (ahead of the checkout's editable install)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (site, *more))), "HF_HUB_OFFLINE": "1"}


def test_the_wheel_carries_the_tiny_family_and_the_presets_not_the_smollm2_heads(wheel):
    assert wheel.stat().st_size <= MOST_BYTES
    names = set(zipfile.ZipFile(wheel).namelist())
    parts = ("target", "draft", "medusa", "eagle", "eagle3", "peagle", "mtp", "dflash", "dflash2", "dspark", "pard")
    for part in (*parts, "pard2"):
        assert any(n.startswith(f"specbench/zoo/tiny/{part}/") and n.endswith(".safetensors") for n in names), part
    assert "specbench/_presets/methods/vanilla.yaml" in names and "specbench/_presets/tasks/quick.yaml" in names
    assert not [n for n in names if n.startswith("specbench/zoo/smollm2/") and not n.endswith("MODEL_CARD.md")]
    assert not [n for n in names if n.startswith("tests/") or "__pycache__" in n]


def test_the_default_run_works_from_the_wheel_alone(site, tmp_path):
    env = away(site)
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


def test_the_heads_wheel_carries_the_smollm2_head_folders_alone_at_specbenchs_version(wheel, heads_wheel):
    names = {n for n in zipfile.ZipFile(heads_wheel).namelist() if ".dist-info/" not in n}
    expected = {
        f"specbench_smollm2_heads/{path.relative_to(head.parent).as_posix()}"
        for head in SMOLLM2_HEADS
        for path in head.rglob("*")
        if path.is_file()
    }
    assert names == expected | {"specbench_smollm2_heads/__init__.py"}
    assert all(any(n.startswith(f"specbench_smollm2_heads/{h.name}/") for n in names) for h in SMOLLM2_HEADS)
    assert any(n.endswith(".safetensors") for n in names) and any(n.endswith("/config.json") for n in names)
    version = wheel.name.split("-")[1]
    assert heads_wheel.name.startswith(f"specbench_smollm2_heads-{version}-")
    metadata = zipfile.ZipFile(wheel).read(f"specbench-{version}.dist-info/METADATA").decode()
    assert f"Requires-Dist: specbench-smollm2-heads=={version}; extra == 'smollm2'" in metadata


def test_installed_from_the_wheels_smollm2_finds_its_heads_in_the_heads_package(site, heads_wheel, tmp_path):
    heads = install(heads_wheel, tmp_path / "heads")
    show = (
        "from specbench.models.aliases import ALIASES; print(*(s.id for s in ALIASES['smollm2-135m'].heads.values()))"
    )
    found = subprocess.run(
        [sys.executable, "-c", show], cwd=tmp_path, env=away(site, heads), capture_output=True, text=True, check=True
    )
    paths = found.stdout.split()
    assert sorted(Path(p).name for p in paths) == [h.name for h in SMOLLM2_HEADS]
    assert all(Path(p).is_relative_to(heads / "specbench_smollm2_heads") for p in paths), paths
    # without the heads package, a method that needs a head says how to get them
    run = shlex.split("run --model smollm2-135m --methods eagle3 --dry-run")
    done = subprocess.run(
        [sys.executable, "-m", "specbench.cli", *run], cwd=tmp_path, env=away(site), capture_output=True, text=True
    )
    assert done.returncode == 2 and 'pip install "specbench[smollm2]"' in done.stderr, done.stderr[-2000:]
