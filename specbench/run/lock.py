"""A run's checkpoints pinned to commits: the lock file `specbench lock` (or the first run of an unpinned hub
checkpoint) writes, and `run --lock` applies, so a run whose repositories an alias or `--model` leaves at a branch
loads the same weights again later, or elsewhere."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import Plan
from ..errors import SpecbenchError
from ..models import hub
from ..models.hub import Checkpoint, Layout, Source

FORMAT = 1
FILE = "specbench.lock.json"  # `specbench lock`'s default, and its name in a run folder


def is_hub(source: Source) -> bool:
    return not source.local and not source.gguf


def unpinned(source: Source) -> bool:
    """A hub checkpoint asked for at a branch, a tag or the default branch: what it loads can change."""
    return is_hub(source) and not (source.revision and hub.COMMIT.match(source.revision))


def unpinned_note(ck: Checkpoint) -> str:
    """What `--dry-run` adds to an unpinned checkpoint's line: the commit it would run with, and where from."""
    if not unpinned(ck.source):
        return ""
    if ck.listing.commit is None:
        return "; unpinned: no cached commit"
    where = "hub" if ck.listing.hub_reachable else "cached"
    return f"; unpinned: {where} commit {ck.listing.commit[:7]}…"


def cached_only(plan: Plan) -> list[str]:
    """One line per unpinned checkpoint that runs from the local cache alone (the hub not asked): which commit."""
    return [
        f"specbench: {role} '{ck.source}' is unpinned and {ck.listing.note}: it runs the cached commit "
        f"{ck.listing.commit}"
        for role, ck in plan.checkpoints.items()
        if unpinned(ck.source) and ck.files and not ck.listing.hub_reachable
    ]


def _entry(role: str, ck: Checkpoint) -> dict[str, str]:
    """A checkpoint's line of the lock: a hub repository at its commit, else where it is (nothing to resolve)."""
    if not is_hub(ck.source):
        kind = "local" if ck.source.local else "wheel"
        return {kind: ck.source.id, **({"revision": ck.source.revision} if ck.source.revision else {})}
    if ck.listing.commit is None:
        raise SpecbenchError(
            f"{role} '{ck.source}' resolves to no commit: it is not in the local hub cache and {ck.listing.note}; "
            "run `specbench lock` once with the hub reachable, or pin it as ID@COMMIT"
        )
    return {"repository": ck.source.id, "commit": ck.listing.commit}


def entries(plan: Plan) -> dict:
    """The lock of a plan: every checkpoint by role, each hub one at the commit its listing resolved to."""
    roles = {role: _entry(role, ck) for role, ck in plan.checkpoints.items()}
    return {"format": FORMAT, "model": plan.spec.name, "checkpoints": roles}


def write(path: Path, plan: Plan) -> dict:
    """Write the plan's lock to `path`; returns what it holds."""
    data = entries(plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


def describe(data: dict) -> list[str]:
    """The lock's checkpoints, one line each, as `specbench lock` prints them."""
    width = max(map(len, data["checkpoints"]))
    lines = []
    for role, entry in data["checkpoints"].items():
        if "repository" in entry:
            where = f"{entry['repository']} @ {entry['commit']}"
        elif "local" in entry:
            where = f"{entry['local']}  [local: no commit]"
        else:
            where = f"{entry['wheel']}  [wheel member: {entry.get('revision', 'no checksum')}]"
        lines.append(f"  {role:<{width}}  {where}")
    return lines


def record(plan: Plan, folder: Path) -> None:
    """A run with an unpinned checkpoint keeps the commits it ran beside its manifest (the first run's, when it
    resumes), so `run --lock` repeats it."""
    path = folder / FILE
    if path.exists() or not any(unpinned(ck.source) for ck in plan.checkpoints.values()):
        return
    write(path, plan)
    print(
        f"specbench: unpinned checkpoints ran at the commits in {path}: `--lock {path}` runs them again",
        file=sys.stderr,
    )


@dataclass(frozen=True)
class Lock:
    """The commits a lock file pins, by repository."""

    path: Path
    commits: dict[str, str]  # repository -> 40-hex commit

    def names(self, source: Source) -> bool:
        return is_hub(source) and source.id in self.commits

    def checkpoint(self, role: str, source: Source, layout: Layout) -> Checkpoint:
        """The checkpoint at the lock's commit, which wins over the source's own revision; a commit neither cached
        nor reachable is an error here (a run pinned by a lock never falls back to other weights)."""
        commit = self.commits[source.id]
        if source.revision and hub.COMMIT.match(source.revision) and source.revision != commit:
            print(
                f"specbench: note: {role} '{source.id}' runs at {commit[:7]}… from {self.path}, not at its pinned "
                f"{source.revision[:7]}…",
                file=sys.stderr,
            )
        ck = hub.checkpoint(role, Source(source.id, commit), layout)
        if not ck.files:
            raise SpecbenchError(
                f"{role} '{source.id}' is locked at commit {commit} ({self.path}), not in the local hub cache, and "
                f"{ck.listing.note}: run once with the hub reachable to download that commit"
            )
        return ck


def read(path: str | Path, model: str) -> Lock:
    """The lock file at `path`, for `model` (a lock of another model is an error)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise SpecbenchError(f"cannot read lock file {path} ({err.strerror}): make one with `specbench lock`") from err
    except ValueError as err:
        raise SpecbenchError(f"lock file {path} is not JSON ({err}): make it again with `specbench lock`") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SpecbenchError(f"{path} is not a format-{FORMAT} lock file: make it again with `specbench lock`")
    if data.get("model") != model:
        raise SpecbenchError(
            f"lock file {path} is for model '{data.get('model')}', not '{model}': pass that --model, or make a lock "
            "for this one with `specbench lock` and the same --model"
        )
    roles = data.get("checkpoints")
    listed = roles.values() if isinstance(roles, dict) else []
    repos = {e["repository"]: e.get("commit") for e in listed if isinstance(e, dict) and "repository" in e}
    commits = {repo: c for repo, c in repos.items() if isinstance(c, str) and hub.COMMIT.match(c)}
    if len(commits) < len(repos):
        bad = ", ".join(sorted(set(repos) - set(commits)))
        raise SpecbenchError(f"lock file {path} names no 40-hex commit for {bad}: make it again with `specbench lock`")
    return Lock(path, commits)
