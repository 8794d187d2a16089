"""SpotTrainerProcess: the trainer in a worker process trains exactly as the thread's SpotTrainer does from the same
data and seed, takes the parent buffer's segments, follows a refreshed head, stops on an event, checkpoints, and
reports a worker's failure or end as a RuntimeError."""
import threading
import time

import pytest
import torch

from tlt_kernels.drafter import EagleDrafter, RolloutBuffer, SpotTrainer, SpotTrainerProcess

from test_spot_trainer import PermutationTarget

pytestmark = pytest.mark.usefixtures("one_thread")

TRAINER_ARGS = dict(lr=3e-3, warmup_steps=5, batch_size=8, seq_len=16, seed=0)


def _setup():
    """The target, a drafter from seed 0 and a buffer of 16 rollouts of 24 tokens (step 0)."""
    target = PermutationTarget(seed=0)
    torch.manual_seed(0)
    drafter = EagleDrafter.for_target(target, intermediate_size=64)
    buffer = RolloutBuffer(capacity_tokens=4096)
    tokens, features = target.rollout(torch.arange(16) % 32, 24)
    buffer.add(features, tokens, step=0)
    return target, drafter, buffer


def _thread_weights(steps: int):
    """The weights the thread's trainer publishes after ``steps`` optimizer steps from :func:`_setup`."""
    _, drafter, buffer = _setup()
    trainer = SpotTrainer(drafter, buffer, **TRAINER_ARGS)
    trainer.run(max_steps=steps)
    return trainer.holder.latest().state_dict


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-6, msg=name)


def test_the_process_trains_like_the_thread_and_keeps_the_data(tmp_path):
    expected = _thread_weights(5)
    _, drafter, buffer = _setup()
    with SpotTrainerProcess(drafter, buffer, device="cpu", **TRAINER_ARGS) as trainer:
        assert trainer.alive and not trainer.in_process
        trainer.refresh_head(drafter)  # the same head: nothing changes
        stats = trainer.run(max_steps=5)
        assert (stats.stopped_by, stats.optimizer_steps, stats.published_version) == ("max_steps", 5, 1)
        assert buffer.num_tokens == 0 and len(buffer) == 0  # handed to the worker
        _assert_same_weights(trainer.holder.latest().state_dict, expected)
        # The worker keeps the segments: a later run trains without new ones, until the stop event.
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        stats = trainer.run(stop=stop)
        # A stopped run returns once the worker answered: the weights (and exact stats) follow.
        assert stats.stopped_by == "stop" and stats.micro_steps >= 1 and stats.published_version is None
        assert stats.elapsed_s >= 0.3
        deadline = time.monotonic() + 60
        while trainer.holder.version < 2 and time.monotonic() < deadline:  # a lookup publishes them once landed
            time.sleep(0.01)
        assert trainer.holder.version == 2 and trainer.last_stats.published_version == 2
        exact = trainer.last_stats
        assert exact.stopped_by == "stop" and exact.optimizer_steps >= stats.optimizer_steps >= exact.optimizer_steps - 1
        trainer.collect()  # nothing pending: returns at once
        again = threading.Event()
        threading.Timer(0.1, again.set).start()
        trainer.run(stop=again)
        after = trainer.run(max_steps=1)  # takes the stopped run's weights (version 3) first
        assert after.published_version == 4 and trainer.holder.version == 4
        trainer.save_checkpoint(str(tmp_path / "spot.pt"))
    assert not trainer.alive
    trainer.close()  # idempotent
    _, fresh, fresh_buffer = _setup()
    resumed = SpotTrainer(fresh, fresh_buffer, **TRAINER_ARGS)
    resumed.load_checkpoint(str(tmp_path / "spot.pt"))
    assert resumed.holder.version == 4 and resumed.optimizer_steps > 5 + exact.optimizer_steps
    _assert_same_weights(resumed.drafter.state_dict(), trainer.holder.latest().state_dict)
    with pytest.raises(RuntimeError, match="worker has ended"):
        trainer.run(max_steps=1)


def test_a_refreshed_head_reaches_the_worker():
    """Training against another head (the policy after an update) gives other weights; training against the same
    head after a refresh gave the thread's (above)."""
    expected = _thread_weights(3)
    target, drafter, buffer = _setup()
    with torch.no_grad():
        target.lm_head.weight.mul_(-1.0)  # the serving drafter reads the target's head: it sees the update
    with SpotTrainerProcess(drafter, buffer, device="cpu", **TRAINER_ARGS) as trainer:
        trainer.refresh_head(drafter)
        trainer.run(max_steps=3)
        got = trainer.holder.latest().state_dict
    assert any(not torch.allclose(got[name], expected[name]) for name in expected)


def test_refreshes_reuse_their_shared_buffers_and_the_last_one_wins():
    """Two refreshes with no run between: the second refills the first's shared buffers (a tied head is one buffer)
    once the worker has loaded the first, and training then sees the second head (the thread's weights, above)."""
    expected = _thread_weights(3)
    target, drafter, buffer = _setup()
    sent = []
    with SpotTrainerProcess(drafter, buffer, device="cpu", **TRAINER_ARGS) as trainer:
        real_send = trainer._send
        trainer._send = lambda message: (sent.append(message), real_send(message))[1]
        with torch.no_grad():
            target.lm_head.weight.mul_(-1.0)
        trainer.refresh_head(drafter)
        with torch.no_grad():
            target.lm_head.weight.mul_(-1.0)  # back to the head the thread trained against
        trainer.refresh_head(drafter)
        trainer.run(max_steps=3)
        got = trainer.holder.latest().state_dict
    _assert_same_weights(got, expected)
    first, second = [[t for state in m[1] for t in state.values()] for m in sent if m[0] == "head"]
    assert [t.data_ptr() for t in first] == [t.data_ptr() for t in second] and all(t.is_shared() for t in first)
    assert [m[3] for m in sent if m[0] == "head"] == [1, 2]


def test_a_head_the_worker_cannot_load_raises_and_ends_the_worker():
    """The worker reports a head it could not load: the next request that reads its answers raises that error (here
    a run) and ends the worker (answers to later messages may still be on the pipe); later requests raise at once."""
    import types

    _, drafter, buffer = _setup()
    bad = types.SimpleNamespace(shared_modules=(torch.nn.Linear(2, 2),) * 3)  # tensor names the drafter lacks
    with SpotTrainerProcess(drafter, buffer, device="cpu", **TRAINER_ARGS) as trainer:
        trainer.refresh_head(bad)
        with pytest.raises(RuntimeError, match="worker failed(.|\n)*ValueError"):
            trainer.run(max_steps=3)
        assert not trainer.alive
        start = time.monotonic()
        for call in (lambda: trainer.refresh_head(drafter), lambda: trainer.run(max_steps=1)):
            with pytest.raises(RuntimeError, match="ended"):
                call()
        assert time.monotonic() - start < 10.0  # far below the 60 s a lost answer would wait


def test_a_failing_worker_and_bad_arguments_raise():
    _, drafter, buffer = _setup()
    with pytest.raises(RuntimeError, match="batch_size"):  # SpotTrainer's own check, raised in the worker
        SpotTrainerProcess(drafter, buffer, device="cpu", batch_size=0)
    with pytest.raises(TypeError, match="RolloutBuffer"):
        SpotTrainerProcess(drafter, [], device="cpu")
    for threads in (0, 1.5, True):
        with pytest.raises(ValueError, match="cpu_threads"):
            SpotTrainerProcess(drafter, buffer, device="cpu", cpu_threads=threads)


def test_the_buffer_hands_over_its_entries_in_order():
    buffer = RolloutBuffer(capacity_tokens=100, storage_dtype=torch.float32)
    buffer.add(torch.ones(2, 5, 3), torch.zeros(2, 5, dtype=torch.int64), step=1, lengths=[5, 3])
    buffer.add(torch.full((4, 3), 2.0), torch.ones(4, dtype=torch.int64), step=2)
    taken = buffer.take()
    assert [(f.shape[0], t.shape[0], step) for f, t, step in taken] == [(5, 5, 1), (3, 3, 1), (4, 4, 2)]
    assert torch.equal(taken[2][0], torch.full((4, 3), 2.0))
    assert buffer.num_tokens == 0 and len(buffer) == 0 and buffer.take() == []


def test_a_run_stopped_while_the_last_weights_are_on_their_way_trains_nothing():
    """A tail that ends before the previous run's weights have landed must not wait for them: the run returns at
    the stop, sends nothing, and the buffer keeps its segments for the next run."""

    class SilentPipe:  # the worker's weights have not arrived; nothing may be sent
        def poll(self, timeout=0.0):
            return False

        def send(self, message):
            raise AssertionError(f"sent {message[0]!r}")

    _, _, buffer = _setup()
    trainer = SpotTrainerProcess.__new__(SpotTrainerProcess)  # the pipe alone: no worker needed
    trainer.buffer, trainer._conn, trainer._lock = buffer, SilentPipe(), threading.Lock()
    trainer._weights_pending, trainer._running = True, False
    stop = threading.Event()
    stop.set()
    stats = trainer.run(stop=stop)
    assert (stats.stopped_by, stats.micro_steps, stats.published_version) == ("stop", 0, None)
    assert buffer.num_tokens == 16 * 24 and trainer._weights_pending


@pytest.mark.cuda
def test_gpu_an_unindexed_cuda_device_is_the_current_gpu():
    """``device="cuda"`` (the default) names the current GPU: the worker's ``set_device`` needs an index."""
    target, drafter, buffer = _setup()
    with SpotTrainerProcess(drafter.to("cuda"), buffer, device="cuda", **TRAINER_ARGS) as trainer:
        assert trainer.device == torch.device("cuda", torch.cuda.current_device())
        stats = trainer.run(max_steps=2)
        assert (stats.stopped_by, stats.optimizer_steps) == ("max_steps", 2)


@pytest.mark.cuda
def test_gpu_a_head_on_the_gpu_is_refreshed_through_kept_cpu_buffers():
    """A serving drafter on the GPU: each refresh copies its head into the same shared CPU buffers, and the worker
    (on the GPU) trains after two of them."""
    _, drafter, buffer = _setup()
    drafter = drafter.to("cuda")
    sent = []
    with SpotTrainerProcess(drafter, buffer, device="cuda", **TRAINER_ARGS) as trainer:
        real_send = trainer._send
        trainer._send = lambda message: (sent.append(message), real_send(message))[1]
        trainer.refresh_head(drafter)
        trainer.refresh_head(drafter)
        stats = trainer.run(max_steps=2)
    assert (stats.stopped_by, stats.optimizer_steps) == ("max_steps", 2)
    first, second = [[t for state in m[1] for t in state.values()] for m in sent if m[0] == "head"]
    assert all(t.device.type == "cpu" and t.is_shared() for t in first)
    assert [t.data_ptr() for t in first] == [t.data_ptr() for t in second]
    heads = [t for m in drafter.shared_modules for t in m.state_dict().values()]
    assert all(torch.equal(a, b.cpu()) for a, b in zip(second, heads))


def test_begin_and_finish_run_the_worker_without_waiting_on_it():
    """The engine's way: begin() hands over the landed segments and returns at once; nothing else may be asked of
    the worker while it trains; finish() stops it like a stopped run (the weights follow) or takes its weights."""
    _, drafter, buffer = _setup()
    with SpotTrainerProcess(drafter, buffer, device="cpu", **TRAINER_ARGS) as trainer:
        started = time.perf_counter()
        assert trainer.begin()
        assert time.perf_counter() - started < 5.0 and buffer.num_tokens == 0  # handed over, not trained
        assert not trainer.begin()  # one run at a time
        for call in (lambda: trainer.run(max_steps=1), lambda: trainer.refresh_head(drafter),
                     lambda: trainer.save_checkpoint("unused.pt")):
            with pytest.raises(RuntimeError, match="finish"):
                call()
        time.sleep(0.3)
        stats = trainer.finish()
        assert stats.stopped_by == "stop" and stats.micro_steps >= 1 and stats.elapsed_s >= 0.3
        assert trainer.finish().micro_steps == 0  # no run on: empty stats
        trainer.collect()
        assert trainer.holder.version == 1 and trainer.last_stats.published_version == 1
        assert trainer.begin(max_steps=2)  # a run that ends by itself: finish takes its published weights
        deadline = time.monotonic() + 60
        while not trainer._conn.poll() and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = trainer.finish()
        assert (stats.stopped_by, stats.optimizer_steps, stats.published_version) == ("max_steps", 2, 2)
        assert trainer.holder.version == 2


def test_take_can_leave_the_copies_still_in_flight():
    """``take(landed_only=True)`` never waits: entries without a pending copy are taken; one whose copy has not
    landed stays, counted, for the next take."""

    class Pending:
        def query(self):
            return False

    buffer = RolloutBuffer(capacity_tokens=100, storage_dtype=torch.float32)
    buffer.add(torch.ones(5, 3), torch.zeros(5, dtype=torch.int64), step=1)
    buffer.add(torch.ones(4, 3), torch.zeros(4, dtype=torch.int64), step=2)
    buffer._entries[1].ready = Pending()
    taken = buffer.take(landed_only=True)
    assert [(t.shape[0], step) for _, t, step in taken] == [(5, 1)]
    assert buffer.num_tokens == 4 and len(buffer) == 1
    buffer._entries[0].ready = None  # landed
    assert [t.shape[0] for _, t, _ in buffer.take(landed_only=True)] == [4] and buffer.num_tokens == 0


def test_a_failed_hand_over_is_raised_by_finish():
    """begin() hands the segments over on a short-lived thread; its failure (a broken pipe) surfaces at finish(),
    and the pipe's lock is free again."""
    from types import SimpleNamespace

    class BrokenPipe:
        def poll(self, timeout=0.0):
            return False

        def send(self, message):
            raise BrokenPipeError("the pipe broke")

    _, _, buffer = _setup()
    trainer = SpotTrainerProcess.__new__(SpotTrainerProcess)  # the pipe alone: no worker needed
    trainer.buffer, trainer._conn, trainer._lock = buffer, BrokenPipe(), threading.Lock()
    trainer._weights_pending, trainer._running = False, False
    trainer._process = SimpleNamespace(is_alive=lambda: True)
    assert trainer.begin() and buffer.num_tokens == 0
    with pytest.raises(RuntimeError, match="starting the run failed: the pipe broke"):
        trainer.finish()
    assert not trainer._running and not trainer._lock.locked()


def test_a_worker_silent_at_finish_is_ended_not_waited_for(monkeypatch):
    """A hung worker must not hang the rollout's end: finish() waits a bounded time for the answer to its stop, then
    ends the worker and raises."""
    from types import SimpleNamespace

    import tlt_kernels.drafter.spot_process as spot_process

    class SilentPipe:
        def __init__(self):
            self.sent, self.closed = [], False

        def poll(self, timeout=0.0):
            return False

        def send(self, message):
            self.sent.append(message[0])

        def close(self):
            self.closed = True

    class HungProcess:
        alive, exitcode = True, None

        def is_alive(self):
            return self.alive

        def join(self, timeout=None):
            pass

        def terminate(self):
            self.alive = False

    monkeypatch.setattr(spot_process, "_ANSWER_TIMEOUT_S", 0.05)
    _, _, buffer = _setup()
    trainer = SpotTrainerProcess.__new__(SpotTrainerProcess)  # the pipe alone: no worker needed
    trainer.buffer, trainer._conn, trainer._lock = buffer, SilentPipe(), threading.Lock()
    trainer._weights_pending, trainer._running, trainer._process = False, False, HungProcess()
    trainer._holder = SimpleNamespace(version=0)
    assert trainer.begin()
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="no .* from the worker within"):
        trainer.finish()
    assert time.perf_counter() - started < 5.0
    assert trainer._conn.sent == ["add", "train", "stop", "close"] and trainer._conn.closed
    assert not trainer.alive and not trainer._running
