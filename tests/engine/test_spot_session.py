"""SpotSession (tlt_kernels.engine.spot): the spot trainer's thread starts only in the tail with a non-empty buffer,
the interpreter's switch interval is lowered while it runs and restored when it stops (after an error too), and the
engine checks ``spot_switch_interval_s``."""
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from tlt_kernels.engine.spot import SpotSession


class WaitingTrainer:
    """A trainer whose run lasts until it is told to stop; it records the switch interval it ran under."""

    def __init__(self, tokens: int = 10):
        self.buffer = SimpleNamespace(num_tokens=tokens)
        self.device = torch.device("cpu")
        self.started = threading.Event()
        self.interval_seen = None

    def run(self, stop):
        self.interval_seen = sys.getswitchinterval()
        self.started.set()
        stop.wait()
        return SimpleNamespace(micro_steps=0, optimizer_steps=0, tokens=0, elapsed_s=0.0, last_loss=None,
                               published_version=0)


@pytest.fixture
def switch_interval():
    """The interpreter's interval before the test, restored after it whatever happened."""
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_the_interval_is_lowered_while_the_trainer_runs(switch_interval):
    trainer = WaitingTrainer()
    session = SpotSession(trainer, 0.25, 16, switch_interval_s=1e-4)
    session.maybe_start(8)  # not the tail yet
    assert not session.running and sys.getswitchinterval() == switch_interval
    session.maybe_start(3)
    assert session.running and trainer.started.wait(10)
    assert trainer.interval_seen == pytest.approx(1e-4) and sys.getswitchinterval() == pytest.approx(1e-4)
    session.stop()
    assert sys.getswitchinterval() == switch_interval and "error" not in session.result
    session.stop()  # idempotent: the engine stops it at the rollout's end and after an error
    assert sys.getswitchinterval() == switch_interval


def test_no_start_without_tokens_and_no_change_without_an_interval(switch_interval):
    empty = SpotSession(WaitingTrainer(tokens=0), 0.25, 16, switch_interval_s=1e-4)
    empty.maybe_start(1)
    assert not empty.running and sys.getswitchinterval() == switch_interval
    trainer = WaitingTrainer()
    untouched = SpotSession(trainer, 0.25, 16, switch_interval_s=None)
    untouched.maybe_start(1)
    assert trainer.started.wait(10) and trainer.interval_seen == switch_interval
    untouched.stop()


def test_the_engine_checks_the_interval():
    from conftest import tiny_trained_target
    from tlt_kernels.engine import SpeculativeEngine

    target = tiny_trained_target()
    for bad in (0, -1e-3, float("inf"), True, "1ms"):
        with pytest.raises(ValueError, match="spot_switch_interval_s"):
            SpeculativeEngine(target, max_batch_size=2, max_seq_len=32, spot_switch_interval_s=bad)
    assert SpeculativeEngine(target, max_batch_size=2, max_seq_len=32, spot_switch_interval_s=None)


class BeginningTrainer:
    """A trainer of its own process (``begin``/``finish``): declines its first ``declines`` begins, or raises."""

    in_process = False

    def __init__(self, declines: int = 0, error: bool = False):
        self.buffer = SimpleNamespace(num_tokens=10)
        self.declines, self.error = declines, error
        self.begins = self.finishes = 0

    def begin(self):
        self.begins += 1
        if self.error:
            raise RuntimeError("the worker has ended")
        return self.begins > self.declines

    def finish(self):
        self.finishes += 1
        return SimpleNamespace(micro_steps=3, optimizer_steps=3, tokens=96, elapsed_s=0.5, last_loss=1.0,
                               published_version=None)


def test_a_trainer_of_its_own_process_is_begun_and_finished_without_a_thread(switch_interval):
    trainer = BeginningTrainer(declines=1)
    session = SpotSession(trainer, 0.25, 16, switch_interval_s=1e-4)
    session.maybe_start(3)  # declined (its last weights on the way): asked again at the next step
    assert not session.running and trainer.begins == 1
    session.maybe_start(3)
    assert session.running and not session.threaded and session.thread is None and trainer.begins == 2
    assert sys.getswitchinterval() == switch_interval  # no thread of ours: the interval is left alone
    session.maybe_start(2)  # running: not begun again
    assert trainer.begins == 2
    session.stop()
    session.stop()  # idempotent
    assert trainer.finishes == 1 and not session.running
    assert session.result["micro_steps"] == 3 and session.result["version"] is None


def test_a_trainer_that_fails_to_begin_is_reported_and_not_asked_again():
    trainer = BeginningTrainer(error=True)
    session = SpotSession(trainer, 0.25, 16)
    session.maybe_start(3)
    session.maybe_start(2)
    session.stop()
    assert trainer.begins == 1 and trainer.finishes == 0
    assert session.result == {"error": "RuntimeError: the worker has ended"}
