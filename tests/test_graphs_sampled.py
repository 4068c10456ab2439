"""`--graphs` at T = 1 on the CPU: every method draws the eager loop's tokens from the same laws (the same random
numbers used the same way), so it passes the sampling audit exactly when the eager loop does. Eight tokens a turn:
every method still commits over several steps, at half the greedy test's cost."""

from .test_graphs import eager_and_graphs


def test_every_method_under_graphs_samples_the_eager_tokens(tmp_path):
    eager_and_graphs(tmp_path, 1, tokens=8)
