"""Training text for heads, as token streams: a JSONL file ("text" per line), a plain-text file (documents
separated by blank lines), or a data folder read by the zoo's corpus builder (the tiny family's own split); and the
prompts `specbench regenerate` answers. What the command line names is judged here without torch (`check_text`,
`check_prompts`, `check_draft_text`), before a command's heavy imports."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SpecbenchError
from ..tasks import read_jsonl

if TYPE_CHECKING:
    import torch

    from .corpus import Corpus


def zoo_corpus(path: Path, smoke: bool) -> Corpus:
    """The zoo corpus of a data folder, split as the tiny target was trained."""
    from .corpus import build_corpus
    from .plan import FULL, SMOKE

    plan = SMOKE if smoke else FULL
    return build_corpus(
        path,
        seed=0,
        heldout_frac=plan.heldout_frac,
        max_article_chars=plan.max_article_chars,
        per_source_limit=plan.per_source_limit,
    )


def jsonl_texts(path: Path) -> list[str]:
    """The "text" field of every record of a JSONL file (what `specbench regenerate` writes)."""
    records = read_jsonl(path)
    for n, row in enumerate(records, 1):
        if not isinstance(row.get("text"), str):
            raise SpecbenchError(f'{path}: record {n} has no string field "text"; each line needs one')
    return [row["text"] for row in records]


def check_text(path: Path) -> None:
    """Training text that is there: a file, or a data folder."""
    if not path.is_dir() and not path.is_file():
        raise SpecbenchError(
            f"training data '{path}' is neither a file nor a folder: pass a .jsonl or text file, or a data folder"
        )


def check_prompts(path: Path) -> None:
    """Prompts to answer that are there: a data folder, or a JSONL file."""
    if not path.is_dir() and (path.suffix != ".jsonl" or not path.is_file()):
        raise SpecbenchError(f"prompts '{path}' must be a data folder or a .jsonl file")


def check_draft_text(path: Path) -> None:
    """`zoo build --draft-text`: a JSONL file of "text" lines (what `specbench regenerate` writes) that is there."""
    if not path.is_file():
        raise SpecbenchError(f"--draft-text '{path}' is not a file: pass a JSONL of \"text\" lines")


def _documents(path: Path, smoke: bool) -> tuple[list[str], list[str]]:
    """(train, held-out) texts."""
    check_text(path)
    if path.is_dir():
        corpus = zoo_corpus(path, smoke)
        return [c.render() for c in corpus.train], [c.render() for c in corpus.heldout]
    if path.suffix == ".jsonl":
        docs = jsonl_texts(path)
    else:
        docs = [d.strip() for d in path.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    if len(docs) < 2:
        raise SpecbenchError(f"training data '{path}' has fewer than 2 documents (one is held out)")
    cut = max(1, len(docs) // 20)  # the last 5% are held out
    return docs[:-cut], docs[-cut:]


def token_streams(path: Path, tokenizer, smoke: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token ids [N], documents concatenated."""
    import torch

    out = []
    for docs in _documents(path, smoke):
        ids = tokenizer(docs, add_special_tokens=not path.is_dir(), verbose=False)["input_ids"]
        out.append(torch.tensor([t for doc in ids for t in doc], dtype=torch.long))
    return out[0], out[1]
