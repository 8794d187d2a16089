"""Spot training in the rollout's tail: the spot trainer runs on a side thread (and CUDA stream) from the step the
batch falls below a fraction of its start until the rollout ends.

Both threads need the interpreter's lock, and the rollout's loop gives it up at every wait for the GPU; a thread
that wants it back waits until the holder's switch interval runs out (5 ms by default, several decoding steps of
a small model in the tail). While the trainer runs, the session lowers the interval (``switch_interval_s``) and
restores it after. A trainer in a process of its own (:class:`~tlt_kernels.drafter.SpotTrainerProcess`,
``in_process = False``) needs neither the interval, a stream nor a thread: the session starts it with ``begin()``
and ends it with ``finish()``, and the rollout's steps keep overlapping meanwhile (:attr:`SpotSession.threaded`).

The GPU is shared the same way: kernels of two streams interleave at kernel boundaries, and the trainer's large
ones would delay the tail's small ones. The rollout therefore runs on a stream of the device's highest priority
(:func:`priority_stream`; a graph launched into it runs at its priority) and the trainer on a stream of the lowest.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator, Optional

import torch


# Torch maps a priority outside the device's range to the nearest one it has: this asks for the highest.
_HIGHEST_PRIORITY = -(1 << 10)


@contextlib.contextmanager
def priority_stream(device: torch.device, stream: Optional["torch.cuda.Stream"]) -> Iterator[None]:
    """Work in the block runs on ``stream`` (a stream of ``device``; None: the current stream, unchanged), ordered
    after the caller's stream's work before it and before the caller's work after it."""
    if stream is None:
        yield
        return
    caller = torch.cuda.current_stream(device)
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)


def highest_priority_stream(device: torch.device) -> "torch.cuda.Stream":
    """A new stream of ``device`` at the device's highest priority."""
    return torch.cuda.Stream(device, priority=_HIGHEST_PRIORITY)


class SpotSession:
    """One rollout's spot-training run. ``result``: the trainer's stats (or ``{"error": ...}``), empty until it ran."""

    def __init__(self, trainer, batch_fraction: float, start_batch_size: int,
                 switch_interval_s: Optional[float] = None):
        self.trainer, self.batch_fraction, self.start_batch_size = trainer, batch_fraction, start_batch_size
        self.switch_interval_s = switch_interval_s  # while the trainer runs (None: leave the interpreter's)
        self._saved_interval: Optional[float] = None
        self.stop_event = threading.Event()
        self.result: dict = {}
        self.thread: Optional[threading.Thread] = None
        self.begun = False  # a trainer of its own process, started with begin()

    @property
    def running(self) -> bool:
        return self.thread is not None or self.begun

    @property
    def threaded(self) -> bool:
        """Whether a thread of this process runs the trainer now (it shares the interpreter with the rollout)."""
        return self.thread is not None

    def maybe_start(self, running_requests: int) -> None:
        """Start once the batch (``running_requests`` > 0) is in the tail and the buffer holds tokens. A trainer of
        its own process may decline (its last run's weights still on the way): it is asked again at the next step."""
        if (self.trainer is not None and not self.running and "error" not in self.result and running_requests
                and running_requests < self.batch_fraction * self.start_batch_size
                and self.trainer.buffer.num_tokens > 0):
            if callable(getattr(self.trainer, "begin", None)):  # its own process: no thread of ours waits on it
                self._begin()
                return
            if self.switch_interval_s is not None and self._in_process:
                self._saved_interval = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved_interval, self.switch_interval_s))
            self.thread = threading.Thread(target=self._body, name="tlt-spot-trainer", daemon=True)
            self.thread.start()

    @property
    def _in_process(self) -> bool:
        """Whether the trainer's Python and kernels run in this process (not a :class:`SpotTrainerProcess`'s)."""
        return getattr(self.trainer, "in_process", True)

    def stop(self) -> None:
        if self.begun:
            self.begun = False
            self._report(self.trainer.finish)
        if self.thread is not None:
            self.stop_event.set()
            self.thread.join()
        if self._saved_interval is not None:
            sys.setswitchinterval(self._saved_interval)
            self._saved_interval = None

    def _body(self) -> None:
        trainer = self.trainer
        try:
            if trainer.device.type == "cuda" and self._in_process:
                side = torch.cuda.Stream(trainer.device, priority=0)  # the lowest: the rollout's kernels go first
                # After the work already queued on the trainer's device (e.g. a replica's head refreshed there).
                side.wait_stream(torch.cuda.current_stream(trainer.device))
                with torch.cuda.stream(side):
                    self._report(lambda: trainer.run(stop=self.stop_event))
            else:
                self._report(lambda: trainer.run(stop=self.stop_event))
        except Exception as exc:  # pragma: no cover - reported, never kills the rollout
            self.result["error"] = f"{type(exc).__name__}: {exc}"

    def _begin(self) -> None:
        """Start a trainer of its own process (an error goes to :attr:`result`: no further start in this rollout)."""
        try:
            self.begun = self.trainer.begin()
        except Exception as exc:
            self.result["error"] = f"{type(exc).__name__}: {exc}"

    def _report(self, run) -> None:
        """``run()``'s stats into :attr:`result` (its error instead: a trainer's failure never ends the rollout)."""
        try:
            stats = run()
        except Exception as exc:
            self.result["error"] = f"{type(exc).__name__}: {exc}"
            return
        self.result.update(micro_steps=stats.micro_steps, optimizer_steps=stats.optimizer_steps, tokens=stats.tokens,
                           seconds=stats.elapsed_s, last_loss=stats.last_loss, version=stats.published_version)
