"""The spot trainer in a process of its own.

Why a process: a trainer on a thread of the rollout's process shares its interpreter lock, and next to a busy
trainer thread the rollout's host work per step takes about twice as long whatever the switch interval
(docs/DRAFTERS.md). A worker process has an interpreter of its own, and the rollout only talks to it over a pipe.

:class:`SpotTrainerProcess` has the part of :class:`SpotTrainer`'s interface the engine drives (``buffer``,
``holder``, ``device``, :meth:`run`), so ``SpeculativeEngine(spot_trainer=SpotTrainerProcess(...))`` works as with
the thread; the engine starts it with :meth:`begin` and ends it with :meth:`finish` instead, so that no thread of
the rollout's process waits on the pipe in the tail (a side thread waking every few ms cost the tail's steps as much
as the interpreter lock did). The worker (spawned, so CUDA starts fresh in it) owns a replica of the drafter, its own
:class:`RolloutBuffer` and a :class:`SpotTrainer`. Messages, each a tuple over one pipe; tensors travel as CPU
tensors in shared memory (torch.multiprocessing's file-descriptor sharing, no pickled copy of their bytes):

* parent -> worker: ``("add", features, tokens, lengths, steps)`` the rollout segments taken from the parent's
  buffer since the last run; ``("head", states, loaded, number)`` the target's embedding, head and final norm after
  a policy update, in shared buffers the parent keeps and refills (the worker writes ``number`` into the shared
  ``loaded`` once it has copied them, and the parent refills them only after that);
  ``("train", max_steps, time_budget_s, publish)``; ``("stop",)``; ``("save", path)``; ``("close",)``.
* worker -> parent: ``("ready",)``; for a run that ends by itself ``("trained", stats, version, state_dict or
  None)``; for a stopped one ``("stopped", counts)`` at once (a listener thread in the worker answers while the
  trainer finishes its micro-step), then ``("weights", stats, version, state_dict or None)``; ``("saved",)``;
  ``("error", traceback)``.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import traceback
import warnings
from typing import Optional

import torch

from .buffer import RolloutBuffer
from .eagle import EagleDrafter
from .spot_trainer import RunStats, SpotTrainer, stop_check
from .weights import WeightsHolder

_POLL_S = 0.002  # how often a waiting run looks at its stop condition: far below a rollout, far above a syscall
# The worker answers a stop within a few ms (a listener thread); one silent this long is taken for hung (ended, and
# a RuntimeError), so a rollout's end never waits forever on it.
_ANSWER_TIMEOUT_S = 60.0


class SpotTrainerProcess:
    """A :class:`SpotTrainer` in a spawned worker process on ``device`` (best a GPU the rollout leaves idle).

    Args:
        drafter: the serving drafter; the worker trains a :meth:`~EagleDrafter.replica` of it on ``device``.
        buffer: the parent's :class:`RolloutBuffer`, the one the engine adds finished requests to; each :meth:`run`
            moves its entries to the worker's buffer (same capacity, decay and storage dtype, on the CPU).
        holder: where :meth:`run` publishes the worker's weights (default: a holder on the drafter's device).
        device: the worker's device (``"cuda:1"``, ``"cpu"``, ...). On the rollout's own GPU the two processes'
            kernels time-slice it (stream priorities do not reach across processes): give it an idle GPU.
        start_timeout_s: how long to wait for the worker to start (it imports torch and this package, and runs
            :meth:`SpotTrainer.warm_up` so the first tail trains instead of loading kernels).
        cpu_threads: the worker's intra-op CPU threads (``torch.set_num_threads``). None: 1 on a GPU (its CPU work
            is sampling windows; a pool of one thread per core spins on the cores the rollout's host loop needs),
            torch's default on the CPU.
        trainer_kwargs: :class:`SpotTrainer`'s keyword arguments (``lr``, ``batch_size``, ``unroll_steps``, ...).

    Call :meth:`close` (or use it as a context manager) to end the worker; it also ends with the parent. The worker
    is spawned, so (as for any spawned process) a script that builds one must keep its top level under
    ``if __name__ == "__main__":``: the worker imports the script's module.
    """

    in_process = False  # run() launches no kernel here: the engine's session gives it no stream and no interval

    def __init__(self, drafter: EagleDrafter, buffer: RolloutBuffer, holder: Optional[WeightsHolder] = None, *,
                 device="cuda", start_timeout_s: float = 300.0, cpu_threads: Optional[int] = None,
                 **trainer_kwargs):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the worker's set_device needs an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        if cpu_threads is not None and (isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int)
                                        or cpu_threads < 1):
            raise ValueError(f"SpotTrainerProcess: cpu_threads must be a positive int or None, got {cpu_threads!r}")
        if cpu_threads is None and self.device.type != "cpu":
            cpu_threads = 1
        if not isinstance(buffer, RolloutBuffer):
            raise TypeError(f"SpotTrainerProcess: buffer must be a RolloutBuffer, got {type(buffer).__name__}")
        self.buffer = buffer
        self._holder = holder if holder is not None else WeightsHolder(device=next(drafter.parameters()).device)
        self._lock = threading.Lock()  # one reader of the pipe at a time (run's thread, or a holder lookup)
        self._weights_pending = False  # a stopped run's weights are still to come
        self._running, self._begun_s = False, 0.0  # a run started by begin() and not yet finished
        self._starter: Optional[threading.Thread] = None  # begin()'s hand-over thread
        self._start_error: Optional[BaseException] = None
        self.last_stats: Optional[RunStats] = None  # the last run's exact stats, once its weights arrived
        # The head travels in shared CPU buffers kept from one refresh to the next (a fresh tensor would be copied
        # into new shared memory at every send); keyed by the source tensor's address, so a tied head is one buffer.
        self._head_buffers: dict = {}
        self._head_loaded = torch.zeros(1, dtype=torch.int64).share_memory_()  # the worker's last loaded refresh
        self._head_sent = 0
        ctx = torch.multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        config = dict(capacity_tokens=buffer.capacity_tokens, recency_decay=buffer.recency_decay,
                      storage_dtype=buffer.storage_dtype)
        self._process = ctx.Process(target=_worker_main, name="tlt-spot-trainer", daemon=True,
                                    args=(child, drafter.replica("cpu"), config, str(self.device), cpu_threads,
                                          trainer_kwargs))
        self._process.start()
        child.close()
        self._expect("ready", start_timeout_s)

    def __enter__(self) -> "SpotTrainerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    @property
    def holder(self) -> WeightsHolder:
        """The holder the worker's weights are published into; a lookup first publishes weights that have arrived
        (never waits: the engine looks it up at every step, so weights that land mid-rollout serve from the next)."""
        if self._weights_pending and self._lock.acquire(blocking=False):
            try:
                self._collect(wait=False)
            except RuntimeError as exc:  # the rollout goes on with the weights it has; the next run raises
                self._weights_pending = False
                warnings.warn(f"{exc}; the rollout keeps weights version {self._holder.version}", RuntimeWarning,
                              stacklevel=2)
            finally:
                self._lock.release()
        return self._holder

    def collect(self) -> None:
        """Wait for a stopped run's weights and publish them (:attr:`holder` does so without waiting)."""
        with self._lock:
            self._collect(wait=True)

    def run(self, stop=None, time_budget_s: Optional[float] = None, max_steps: Optional[int] = None,
            publish: bool = True) -> RunStats:
        """Hand the buffer's new segments to the worker and train there until ``stop`` (a ``threading.Event`` or a
        callable, polled every few ms), ``time_budget_s`` or ``max_steps`` optimizer steps.

        A run that ends by itself returns after its weights are published into :attr:`holder` (with ``publish``)
        under the worker's version, as :meth:`SpotTrainer.run` does. A run stopped by ``stop`` returns as soon as
        the worker has answered the stop (within a few ms, not after its micro-step and the weights' transfer):
        its stats count the steps launched by then, ``published_version`` is None, and the weights (and the exact
        stats, :attr:`last_stats`) follow; :attr:`holder` publishes them when they have arrived, :meth:`collect`
        waits for them. A run first waits for the previous run's weights (they come first on the pipe); a stop during
        that wait returns at once with nothing trained and the buffer's segments kept."""
        t0 = time.perf_counter()
        check = stop_check(stop)
        self._check_idle("run")
        with self._lock:
            if not self._await_weights(check):  # stopped first: no training this time, the segments stay
                return RunStats(stopped_by="stop", elapsed_s=time.perf_counter() - t0)
            self._hand_over(self.buffer.take())
            self._send(("train", max_steps, time_budget_s, publish))
            while not self._conn.poll(_POLL_S):  # a wait on the pipe holds no interpreter lock
                if check is not None and check():
                    self._send(("stop",))
                    break
            stats = self._answer()
        stats.elapsed_s = time.perf_counter() - t0
        return stats

    def begin(self, max_steps: Optional[int] = None, time_budget_s: Optional[float] = None,
              publish: bool = True) -> bool:
        """Start a run and return at once: the buffer's segments whose copies have landed go to the worker (sent by
        a short-lived thread), which trains until :meth:`finish` (or ``time_budget_s`` / ``max_steps``). Nothing of
        this process waits on the pipe while it trains: how the engine runs it in a rollout's tail (steps kept
        overlapping). False, starting nothing, while the previous run's weights are on their way or a run is on:
        call again."""
        if self._running or not self._lock.acquire(blocking=False):
            return False
        try:
            self._collect(wait=False)
        except BaseException:
            self._lock.release()
            raise
        if self._weights_pending:
            self._lock.release()
            return False
        segments = self.buffer.take(landed_only=True)
        self._running, self._begun_s, self._start_error = True, time.perf_counter(), None
        # The segments' concatenation and shared-memory copies take milliseconds, mostly outside the interpreter
        # lock: a short-lived thread does them (and releases the pipe's lock) while the rollout steps on.
        self._starter = threading.Thread(target=self._start, args=(segments, ("train", max_steps, time_budget_s,
                                                                               publish)), daemon=True)
        self._starter.start()
        return True

    def _start(self, segments, train_message) -> None:
        """:meth:`begin`'s thread, holding the pipe's lock: hand over the segments, start the run, release."""
        try:
            self._hand_over(segments)
            self._send(train_message)
        except BaseException as exc:  # raised by finish()
            self._start_error = exc
        finally:
            self._lock.release()

    def finish(self) -> RunStats:
        """End the run :meth:`begin` started, as a stopped :meth:`run` ends (the worker answers within a few ms;
        the weights follow) or, if it ended by itself, with its published weights. No run on: empty stats."""
        if not self._running:
            return RunStats()
        self._starter.join()
        self._running = False
        if self._start_error is not None:
            raise RuntimeError(f"SpotTrainerProcess: starting the run failed: {self._start_error}") from self._start_error
        with self._lock:
            if not self._conn.poll():  # a "stop" that crosses the run's own end is moot to the worker
                self._send(("stop",))
            stats = self._answer(_ANSWER_TIMEOUT_S)
        stats.elapsed_s = time.perf_counter() - self._begun_s
        return stats

    def _answer(self, timeout_s: Optional[float] = None) -> RunStats:
        """With the lock held: the worker's answer to a run ("trained": published here; "stopped": weights to come);
        none within ``timeout_s``: the worker is ended and RuntimeError raised."""
        message = self._expect(("trained", "stopped"), timeout_s)
        if message[0] == "stopped":
            self._weights_pending = True
            return RunStats(**message[1])
        return self._publish(message)

    def _check_idle(self, what: str) -> None:
        """The worker reads nothing but "stop" while it trains: other requests wait for :meth:`finish`."""
        if self._running:
            raise RuntimeError(f"SpotTrainerProcess.{what}: a run started by begin() is on; call finish() first")

    def _await_weights(self, check) -> bool:
        """With the lock held: wait for a stopped run's weights (they come before anything else on the pipe) unless
        ``check`` turns true first (False then): a run in a rollout's tail must not hold up its end."""
        while self._weights_pending:
            if self._conn.poll(_POLL_S):
                self._collect(wait=True)
            elif check is not None and check():
                return False
        return True

    def _collect(self, wait: bool) -> None:
        """With the lock held: publish a stopped run's weights, if they are pending (and have arrived, or ``wait``)."""
        if self._weights_pending and (wait or self._conn.poll()):
            self._publish(self._expect("weights"))
            self._weights_pending = False

    def _publish(self, message) -> RunStats:
        """A "trained" or "weights" message: publish its state (when it has one) and keep its stats."""
        _, fields, version, state = message
        stats = RunStats(**fields)
        if state is not None:
            stats.published_version = self._holder.publish(state, version=version).version
        self.last_stats = stats
        return stats

    def _hand_over(self, segments) -> None:
        """Send rollout segments as one features and one tokens tensor (two shared buffers, not two per segment)."""
        if segments:
            features, tokens, steps = zip(*segments)
            self._send(("add", torch.cat(features), torch.cat(tokens), [t.shape[0] for t in tokens], list(steps)))

    def refresh_head(self, source: EagleDrafter) -> None:
        """Send ``source``'s view of the target (embedding, head, final norm) to the worker's replica: after every
        policy update, as :meth:`EagleDrafter.copy_shared_from` does for a replica in this process. The tensors are
        copied into shared buffers kept across refreshes (a tied embedding and head share one), once the worker has
        loaded the previous refresh from them. A stopped run's weights are published here if they have arrived
        (never waited for)."""
        self._check_idle("refresh_head")
        with self._lock:
            self._await_head_loaded()
            kept = {}  # this refresh's buffers by source address: those of a gone source are dropped
            states = [{name: self._head_buffer(t, kept) for name, t in m.state_dict().items()}
                      for m in source.shared_modules]
            self._head_buffers = kept
            self._head_sent += 1
            self._send(("head", states, self._head_loaded, self._head_sent))

    def _head_buffer(self, tensor: torch.Tensor, kept: dict) -> torch.Tensor:
        """The shared CPU buffer for ``tensor``, refilled with its values: the last refresh's (or one made now, on
        first use or when its shape or dtype changed), recorded in ``kept``."""
        key = tensor.data_ptr()
        buffer = kept.get(key, self._head_buffers.get(key))
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
        kept[key] = buffer
        return buffer.copy_(tensor.detach())

    def _await_head_loaded(self) -> None:
        """Wait (normally not at all: a refresh comes once per RL step) until the worker is done with the last refresh,
        so refilling the buffers cannot change what it is copying; a worker that ends or stays silent raises, and so
        does an error it has reported (a head it could not load, say)."""
        self._check_alive()
        deadline = time.monotonic() + _ANSWER_TIMEOUT_S
        while int(self._head_loaded[0]) < self._head_sent:
            if not self._process.is_alive() or time.monotonic() > deadline:
                self.close(timeout_s=0)
                raise RuntimeError(f"SpotTrainerProcess: the worker did not load the head it was sent "
                                   f"(exit code {self._process.exitcode})")
            time.sleep(_POLL_S / 4)
        self._collect(wait=False)  # a stopped run's weights come first on the pipe
        if not self._weights_pending and self._conn.poll():  # nothing else is due now: an error report
            self._expect("nothing")

    def save_checkpoint(self, path: str) -> None:
        """The worker's :meth:`SpotTrainer.save_checkpoint` (weights, optimizer, sampling state), written there."""
        self._check_idle("save_checkpoint")
        with self._lock:
            self._collect(wait=True)
            self._send(("save", str(path)))
            self._expect("saved")

    def close(self, timeout_s: float = 30.0) -> None:
        """Publish a stopped run's weights, then end the worker (idempotent); one that does not end within
        ``timeout_s`` is terminated."""
        if (self._running or self._weights_pending) and self._process.is_alive():
            try:
                self.finish()
                self.collect()
            except RuntimeError as exc:  # ending anyway: say what was lost
                warnings.warn(f"{exc}; closing with weights version {self._holder.version}", RuntimeWarning,
                              stacklevel=2)
        if self._process.is_alive():
            try:
                self._conn.send(("close",))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join()
        self._conn.close()

    def _check_alive(self) -> None:
        if not self._process.is_alive():
            raise RuntimeError(f"SpotTrainerProcess: the worker has ended (exit code {self._process.exitcode})")

    def _send(self, message) -> None:
        self._check_alive()
        self._conn.send(message)

    def _expect(self, kind, timeout_s: Optional[float] = None):
        """The worker's next message, which must be of ``kind`` (a name or a tuple of names); its error report or
        its death raise RuntimeError. An error report or a message out of turn also ends the worker: the answers to
        messages sent after the failed one may still be on the pipe, and a later request would read them as its own."""
        if timeout_s is not None and not self._conn.poll(timeout_s):
            self.close(timeout_s=0)
            raise RuntimeError(f"SpotTrainerProcess: no {kind!r} from the worker within {timeout_s} s")
        try:
            message = self._conn.recv()
        except (EOFError, OSError):  # its end closed the pipe (EOF, or a reset once it was ended)
            self._process.join(5)
            raise RuntimeError(f"SpotTrainerProcess: the worker ended (exit code {self._process.exitcode}) "
                               f"before sending {kind!r}") from None
        if message[0] == "error":
            self._end_worker()
            raise RuntimeError(f"SpotTrainerProcess: the worker failed (it was ended):\n{message[1]}")
        if message[0] not in ((kind,) if isinstance(kind, str) else kind):
            self._end_worker()
            raise RuntimeError(f"SpotTrainerProcess: expected {kind!r} from the worker, got {message[0]!r} (it was "
                               f"ended)")
        return message

    def _end_worker(self) -> None:
        """Terminate the worker now (no goodbye: its pipe may be out of step); later requests raise."""
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)


def _worker_main(conn, replica: EagleDrafter, buffer_config: dict, device: str, cpu_threads: Optional[int],
                 trainer_kwargs: dict) -> None:
    """The worker: build the trainer, report ready (or the error), then serve messages until "close" or EOF."""
    try:
        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        if torch.device(device).type == "cuda":  # no context on the rollout's GPU: every launch goes to ``device``
            torch.cuda.set_device(torch.device(device))
        trainer = SpotTrainer(replica.replica(device), RolloutBuffer(**buffer_config), WeightsHolder(device="cpu"),
                              **trainer_kwargs)
        trainer.warm_up()  # its kernels load now, not in the first rollout's tail
        if replica.weights_version:  # the worker's versions continue the serving drafter's
            trainer.holder.publish(trainer.drafter.state_dict(), version=replica.weights_version)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent has gone
            return
        if message[0] == "close":
            return
        try:
            _serve(conn, trainer, message)
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _serve(conn, trainer: SpotTrainer, message) -> None:
    kind = message[0]
    if kind == "add":
        _, features, tokens, lengths, steps = message
        for f, t, step in zip(features.split(lengths), tokens.split(lengths), steps):
            trainer.buffer.add(f, t, step)  # a copy: the shared buffers are released after
    elif kind == "head":
        _, states, loaded, number = message
        try:
            trainer.drafter.load_shared_states(states)  # synchronous copies: the buffers are read once this returns
        finally:  # loaded or failed (its error follows on the pipe), the parent may refill the buffers
            loaded[0] = number
    elif kind == "train":
        _train(conn, trainer, *message[1:])
    elif kind == "save":
        trainer.save_checkpoint(message[1])
        conn.send(("saved",))
    elif kind != "stop":  # a "stop" that crossed a run's own end is moot
        raise ValueError(f"unknown message {kind!r}")


def _train(conn, trainer: SpotTrainer, max_steps, time_budget_s, publish: bool) -> None:
    """A run; a listener thread answers the parent's stop at once ("stopped", the steps launched so far) and the
    weights follow ("weights"); a run that ends by itself sends them with its stats ("trained")."""
    listener = _StopListener(conn, trainer)
    listener.start()
    try:
        stats = trainer.run(stop=listener.stop, max_steps=max_steps, time_budget_s=time_budget_s, publish=publish)
    finally:  # the listener reads the pipe: it ends before anything else is read or sent
        listener.done.set()
        listener.join()
    latest = trainer.holder.latest()
    fresh = latest is not None and latest.version == stats.published_version
    fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(RunStats)}
    conn.send(("weights" if listener.answered else "trained", fields, trainer.holder.version,
               latest.state_dict if fresh else None))


class _StopListener(threading.Thread):
    """Waits for the parent's "stop" while the worker trains; answers it with the run's counts, then stops the run."""

    def __init__(self, conn, trainer: SpotTrainer):
        super().__init__(name="tlt-spot-stop-listener", daemon=True)
        self.conn, self.trainer = conn, trainer
        self.start_counts = _counts(trainer)
        self.stop, self.done = threading.Event(), threading.Event()
        self.answered = False

    def run(self) -> None:
        while not self.done.is_set():
            if self.conn.poll(_POLL_S):
                self.conn.recv()  # "stop": the parent sends nothing else while a run is on
                self.stop.set()  # first, so no micro-step starts after the counts are read
                micro, steps, tokens = (now - start for now, start in zip(_counts(self.trainer), self.start_counts))
                self.answered = True
                self.conn.send(("stopped", dict(micro_steps=micro, optimizer_steps=steps, tokens=tokens,
                                                stopped_by="stop")))
                return


def _counts(trainer: SpotTrainer):
    """The trainer's running totals: (micro-steps, optimizer steps, tokens seen)."""
    return trainer.micro_steps, trainer.optimizer_steps, trainer.tokens_seen
