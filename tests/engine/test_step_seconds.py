"""What a step's time is (SpeculativeEngine._step_seconds): on CUDA, the GPU's clock between the events after
consecutive steps' staging copies; without events, the host's clock from the launch or the previous read."""
from types import SimpleNamespace

import pytest

from tlt_kernels.engine.engine import SpeculativeEngine


class _Event:
    """A recorded CUDA event's stand-in: ``at`` milliseconds on the GPU's clock."""

    def __init__(self, at: float):
        self.at = at

    def elapsed_time(self, end: "_Event") -> float:
        return end.at - self.at


def _step(ready, started):
    return SimpleNamespace(staged=SimpleNamespace(ready=ready), started=started)


def test_gpu_clock_runs_from_the_previous_steps_end():
    """Overlapped steps: step 2 was launched (host 10.0 s) before step 1 was read, and its read came late (the host
    launched step 3 first); its time is still its own span on the GPU, 4 ms after step 1's end."""
    rollout = SimpleNamespace(last_end=_Event(100.0), last_read_s=0.0)
    first = SpeculativeEngine._step_seconds(rollout, _step(_Event(101.5), 9.0), now=10.5)
    assert first == pytest.approx(1.5e-3)
    second = SpeculativeEngine._step_seconds(rollout, _step(_Event(105.5), 10.0), now=12.0)
    assert second == pytest.approx(4e-3)
    assert rollout.last_read_s == 12.0 and rollout.last_end.at == 105.5


def test_host_clock_without_events():
    """On the CPU (no events) the time runs from the launch, or from the previous read when that came later."""
    rollout = SimpleNamespace(last_end=None, last_read_s=5.0)
    assert SpeculativeEngine._step_seconds(rollout, _step(None, 4.0), now=5.25) == pytest.approx(0.25)
    assert SpeculativeEngine._step_seconds(rollout, _step(None, 6.0), now=6.5) == pytest.approx(0.5)


def test_first_step_without_a_prefill_event_uses_the_host_clock_then_the_gpus():
    rollout = SimpleNamespace(last_end=None, last_read_s=0.0)
    assert SpeculativeEngine._step_seconds(rollout, _step(_Event(10.0), 1.0), now=1.25) == pytest.approx(0.25)
    assert SpeculativeEngine._step_seconds(rollout, _step(_Event(12.0), 1.2), now=2.0) == pytest.approx(2e-3)
