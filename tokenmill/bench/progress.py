"""The bench's progress bar: rich, on stderr, counted in estimated seconds of work.

Each unit of work (one engine's latency run, one engine's throughput phase) moves the
bar by what estimate.py priced it at, so the bar's share and its time left follow the
estimate, corrected by how fast the units really go. Off when stderr is not a terminal
(a pipe or a log file gets the log lines alone).
"""

from __future__ import annotations

from collections.abc import Callable


class RunProgress:
    """A context manager; `price(engine, phase, prompt_len)` gives a unit's estimated seconds
    (prompt_len None for throughput)."""

    def __init__(self, total_s: float, price: Callable[[str, str, str | None], float]):
        from rich.console import Console

        self.total_s = total_s
        self.price = price
        self.console = Console(stderr=True)
        self.bar = None

    def __enter__(self) -> RunProgress:
        if not self.console.is_terminal:
            return self
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        # Log lines written to sys.stderr meanwhile (this process's and its workers') are
        # printed above the bar: rich swaps sys.stderr for a proxy while the bar is live.
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("elapsed,"),
            TimeRemainingColumn(),
            TextColumn("left"),
            console=self.console,
            transient=True,
        )
        self.bar.start()
        self.task = self.bar.add_task("bench", total=max(self.total_s, 1e-6))
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def begin(self, description: str) -> None:
        """The unit now running, shown beside the bar."""
        if self.bar is not None:
            self.bar.update(self.task, description=description)

    def done(self, engine: str, phase: str, prompt_len: str | None = None) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, self.price(engine, phase, prompt_len))
