"""Qwen3's chat template thinks unless told not to: prompts render with thinking off unless a task sets
`thinking: true`, and templates without the switch render as they always did."""

from __future__ import annotations

import json

import pytest

from specbench import tasks
from specbench.errors import SpecbenchError
from specbench.models.aliases import TINY_DIR
from specbench.models.chat import fitting_prompt, has_thinking_switch, prompt_ids, turn_prompts
from specbench.models.loading import load_tokenizer
from specbench.run.runner import _check_manifest

EMPTY_THINK = "<think>\n\n</think>\n\n"
# Qwen3's generation prompt verbatim, around its user and assistant turns
QWEN3 = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
TURNS = ["Name a colour.", "And another?"]


def tokenizer(template: str | None = None):
    """The tiny family's tokenizer, with `template` as its chat template (None: its own, Vicuna's)."""
    tok = load_tokenizer(TINY_DIR / "target")
    if template is not None:
        tok.chat_template = template
    return tok


def task(tmp_path, monkeypatch, **keys) -> str:
    """A built-in-questions task preset with `keys`, in a preset folder of this test's alone."""
    preset = {"questions": [{"question_id": 1, "category": "c", "turns": TURNS}], **keys}
    (tmp_path / "mine.yaml").write_text(json.dumps(preset))
    monkeypatch.setitem(tasks.presets._EXTRA, "tasks", [tmp_path])
    return "mine"


def test_qwen3_prompts_end_with_an_empty_think_block_by_default():
    tok = tokenizer(QWEN3)
    off = prompt_ids(tok, [{"role": "user", "content": TURNS[0]}])
    on = prompt_ids(tok, [{"role": "user", "content": TURNS[0]}], thinking=True)
    assert tok.decode(off).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert tok.decode(on).endswith("<|im_start|>assistant\n")
    assert off[: len(on)] == on and len(off) > len(on)
    assert all(tok.decode(p).endswith(EMPTY_THINK) for p in turn_prompts(tok, TURNS, ["Red."]))
    assert tok.decode(fitting_prompt(tok, TURNS, [], 4096, 1)).endswith(EMPTY_THINK)


def test_a_task_with_thinking_renders_without_the_empty_think_block(tmp_path, monkeypatch):
    loaded = tasks.load(task(tmp_path, monkeypatch, thinking=True))
    question = loaded.questions[0]
    assert loaded.thinking and question.thinking
    ids = fitting_prompt(tokenizer(QWEN3), question.turns, [], 4096, question.id, question.thinking)
    assert EMPTY_THINK not in tokenizer().decode(ids)
    assert not tasks.load("quick").questions[0].thinking  # the default: off


@pytest.mark.parametrize("template", [None, LLAMA3], ids=["tiny", "llama3"])
def test_templates_without_the_switch_render_as_before(template):
    tok = tokenizer(template)
    chat = [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": "Red."}]
    chat.append({"role": "user", "content": TURNS[1]})
    before = list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert prompt_ids(tok, chat) == prompt_ids(tok, chat, thinking=True) == before


def test_a_wrongly_typed_thinking_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(SpecbenchError, match=r"mine\.yaml: key 'thinking': Input should be a valid boolean") as err:
        tasks.load(task(tmp_path, monkeypatch, thinking="yes"))
    assert "\n" not in str(err.value)


def test_the_manifest_records_thinking_only_for_templates_with_the_switch(tmp_path):
    assert not has_thinking_switch(TINY_DIR / "target")
    (tmp_path / "chat_template.jinja").write_text(QWEN3)
    assert has_thinking_switch(tmp_path)


def test_a_run_from_before_the_switch_does_not_resume_with_thinking_off(tmp_path):
    """Runs before the switch rendered Qwen3's prompts thinking: their answers must not mix with non-thinking ones."""
    config = {"methods": ["vanilla"], "repeats": 1, "engine": "specbench"}
    manifest = {"config": config, "machine": {"device_name": "cpu"}}
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    with pytest.raises(SpecbenchError, match="different thinking: pass another --out"):
        _check_manifest(path, {**manifest, "thinking": {"quick": False}})
    _check_manifest(path, {**manifest, "thinking": {"quick": True}})
    assert json.loads(path.read_text())["thinking"] == {"quick": True}
