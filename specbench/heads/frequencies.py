"""How often each token occurs in a head's training text (`token_counts.json` beside the head), and the draft
vocabulary it ranks: the most frequent tokens, which a draft may read out alone (EAGLE-3's draft vocabulary;
FR-Spec's frequency-ranked readout, Zhao et al. 2025: `draft_vocab` of EAGLE-1/2 over the target's vocabulary,
of EAGLE-3 over its draft vocabulary). Drafting fewer candidates changes what is verified, not what is
accepted: outputs stay the target's."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import SpecbenchError

FILE = "token_counts.json"


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ids of the `size` largest counts [V] (ties to the lower id), ascending."""
    return torch.argsort(counts, descending=True, stable=True)[:size].sort().values


def write(folder: Path, stream: torch.Tensor, vocab: int, data: str) -> None:
    """The counts of every token id of `stream` [N] (the training text, as the head saw it) in `folder`."""
    counts = torch.bincount(stream, minlength=vocab).tolist()
    (folder / FILE).write_text(json.dumps({"data": data, "tokens": len(stream), "counts": counts}) + "\n")


def count_text(target: str, data: Path, out: Path, smoke: bool = False) -> int:
    """Count an existing head's training text (as `specbench train --data` reads it, tokenized by the target's
    tokenizer) into `out`, the head's folder (the command has checked it is one); returns the tokens counted."""
    from transformers import AutoConfig

    from ..models import aliases, loading
    from ..zoo.text import token_streams

    folder = aliases.target_folder(aliases.resolve(target))
    vocab = AutoConfig.from_pretrained(folder).get_text_config().vocab_size
    train, _ = token_streams(data, loading.load_tokenizer(folder), smoke)
    write(out, train, vocab, str(data))
    return len(train)


def read(folder: Path, vocab: int, hint: str) -> torch.Tensor:
    """The counts [V] saved in `folder`; a missing or mismatched file says how to make it (`hint`)."""
    path = folder / FILE
    if not path.is_file():
        raise SpecbenchError(f"{path} is missing: the draft vocabulary ranks tokens by it; {hint}")
    try:
        counts = json.loads(path.read_text())["counts"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise SpecbenchError(f"{path} is not a token-count file ({err}); {hint}") from err
    if len(counts) != vocab:
        raise SpecbenchError(f"{path} counts {len(counts)} token ids, the target has {vocab}; {hint}")
    return torch.tensor(counts, dtype=torch.long)
