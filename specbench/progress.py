"""Progress of long loops: a tqdm bar on a terminal, a plain line per tenth of the run anywhere else.

Builds, head training and regeneration run for tens of minutes, usually in the background with stderr in a
log file; a bar there is either silent (tqdm's default off a terminal) or a wall of carriage returns.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, desc: str, unit: str = "it", *, enabled: bool = True) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.lines = enabled and not sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False, disable=not enabled or self.lines)
        self.done, self.postfix, self.start = 0, "", time.perf_counter()
        self.every = max(1, total // 10)
        self.next_line = self.every

    def update(self, n: int = 1, **postfix: str) -> None:
        """Count n more units; `postfix` (e.g. loss="2.31") is shown beside the count."""
        self.done += n
        if postfix:
            self.postfix = " ".join(f"{k} {v}" for k, v in postfix.items())
            self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(n)
        if self.lines and (self.done >= self.next_line or self.done == self.total):
            self.next_line = (self.done // self.every + 1) * self.every
            minutes = (time.perf_counter() - self.start) / 60
            extra = f" {self.postfix}" if self.postfix else ""
            self.write(f"{self.desc}: {self.done}/{self.total} {self.unit}{extra} {minutes:.1f} min")

    def set_description(self, desc: str) -> None:
        self.desc = desc
        self.bar.set_description(desc)

    def write(self, message: str) -> None:
        """A line that does not break the bar."""
        if self.bar.disable:
            print(message, file=sys.stderr, flush=True)
        else:
            self.bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
