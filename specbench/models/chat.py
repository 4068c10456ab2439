"""Turning a conversation into prompt token ids: the model's chat template, or Vicuna v1.1 without one."""

from __future__ import annotations

import functools
from pathlib import Path

from ..errors import SpecbenchError

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)

# FastChat's "vicuna_v1.1" conversation (sep " ", sep2 "</s>") as a Jinja chat template: the one definition of
# the format, carried by the bundled tokenizer and rendered by `vicuna_prompt` for tokenizers without one.
VICUNA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}" + VICUNA_SYSTEM + "{% set loop_messages = messages %}{% endif %}{{ ' ' }}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ' }}"
    "{% else %}{{ 'ASSISTANT: ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def vicuna_prompt(messages: list[dict[str, str]], bos: str = "", eos: str = "</s>") -> str:
    """Render a conversation (ending with a user turn) in the Vicuna v1.1 format, generation prompt included.
    With bos "" the text is FastChat's `get_prompt()`, which the tokenizer then prefixes with its BOS id."""
    return _vicuna().render(messages=messages, bos_token=bos, eos_token=eos, add_generation_prompt=True)


@functools.cache
def _vicuna():
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # as transformers renders chat templates

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(VICUNA_TEMPLATE)


def prompt_ids(tokenizer, messages: list[dict[str, str]], thinking: bool = False) -> list[int]:
    """Token ids of the prompt for the next assistant turn of `messages`. Without transformers' warning on a prompt
    longer than the tokenizer's maximum: callers hold prompts to the model's context themselves (`fitting_prompt`
    refuses one in a line, which that warning would precede). `thinking` is the template's `enable_thinking`
    (Qwen3's thinks unless told not to; the drafters published for it are trained without): templates that do not
    read the variable ignore it."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            enable_thinking=thinking,
            tokenizer_kwargs={"verbose": False},
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    text = vicuna_prompt(messages, eos=tokenizer.eos_token or "</s>")
    return tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"]


def messages(turns: list[str], answers: list[str]) -> list[dict[str, str]]:
    """A conversation: each user turn followed by its answer, while answers last; the rest of `turns` unanswered.
    The prompt for turn t is `messages(turns[: t + 1], answers[:t])`."""
    out = []
    for n, turn in enumerate(turns):
        out.append({"role": "user", "content": turn})
        if n < len(answers):
            out.append({"role": "assistant", "content": answers[n]})
    return out


def turn_prompts(tokenizer, turns: list[str], answers: list[str], thinking: bool = False) -> list[list[int]]:
    """The prompt ids of each answered turn, rebuilt from the answer texts (vanilla's, for the greedy check)."""
    return [prompt_ids(tokenizer, messages(turns[: n + 1], answers[:n]), thinking) for n in range(len(answers))]


def fitting_prompt(
    tokenizer, turns: list[str], answers: list[str], context: int, question: str | int, thinking: bool = False
) -> list[int]:
    """The prompt ids of the turn after `answers`, or one line naming the question when they fill the model's context
    (no room left to answer)."""
    ids = prompt_ids(tokenizer, messages(turns[: len(answers) + 1], answers), thinking)
    if len(ids) >= context:
        raise SpecbenchError(
            f"question {question}: its prompt has {len(ids)} tokens, more than the model's context of {context}; "
            "drop it from the task or use a model with a longer context"
        )
    return ids


def has_thinking_switch(folder: Path) -> bool:
    """Whether the chat template in a checkpoint folder reads `enable_thinking` (Qwen3's), read from its files
    without loading the tokenizer: only then does a task's `thinking` change its prompts."""
    files = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")
    return any("enable_thinking" in (folder / name).read_text() for name in files if (folder / name).is_file())
