import torch

from specbench.progress import Progress


def lines(capsys) -> list[str]:
    """What went to stderr, which under pytest's capture is not a terminal (as in a log file or CI)."""
    return capsys.readouterr().err.splitlines()


def test_off_a_terminal_one_line_per_tenth(capsys):
    bar = Progress(20, "train eagle", "steps")
    for i in range(20):
        bar.update(loss=f"{i / 10:.3f}")
    bar.close()
    err = capsys.readouterr().err
    out = err.splitlines()
    assert [line.split(" min")[0].rsplit(" ", 1)[0] for line in out] == [
        f"train eagle: {2 * k}/20 steps loss {(2 * k - 1) / 10:.3f}" for k in range(1, 11)
    ]
    assert "\r" not in err


def test_short_runs_report_every_unit_and_big_updates_one_line(capsys):
    bar = Progress(3, "regenerate answers", "prompts")
    bar.update()
    bar.update(2)
    assert [line.split(" 0.")[0] for line in lines(capsys)] == [
        "regenerate answers: 1/3 prompts",
        "regenerate answers: 3/3 prompts",
    ]
    bar = Progress(100, "questions", "questions")
    bar.update(35)  # past three tenths at once: one line, the next at 40
    bar.update(4)
    bar.update(1)
    assert [line.split(" 0.")[0] for line in lines(capsys)] == [
        "questions: 35/100 questions",
        "questions: 40/100 questions",
    ]


def test_disabled_progress_prints_nothing_but_messages(capsys):
    bar = Progress(10, "questions", "questions", enabled=False)
    bar.update(10)
    bar.write("a message")
    bar.set_description("other")
    bar.close()
    assert lines(capsys) == ["a message"]


def test_a_model_load_says_what_loads_and_keeps_transformers_bar_out_of_a_log(capsys, tiny_models):
    from transformers.utils import logging as hf_logging

    from specbench.models.loading import load_causal_lm

    target, _ = tiny_models
    load_causal_lm(target, torch.device("cpu"), torch.float32, "target")
    err = capsys.readouterr().err
    assert err.startswith(f"loading target: {target} (float32 on cpu)\n") and "Loading weights" not in err
    assert hf_logging.is_progress_bar_enabled()  # restored for whatever runs next
