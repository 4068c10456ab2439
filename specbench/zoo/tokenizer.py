"""A byte-level BPE tokenizer with the Vicuna chat template, trained on the corpus."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from specbench.models.chat import VICUNA_TEMPLATE

UNK, BOS, EOS = "<unk>", "<s>", "</s>"  # ids 0, 1, 2 as in Llama


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on `texts`; `tokenizer(text)` prepends `<s>`, the chat template writes its own."""
    core = Tokenizer(models.BPE(unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[UNK, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, core.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=UNK,
        chat_template=VICUNA_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
