"""Spot trainer: trains the EAGLE drafter in the GPU's idle windows of an RL rollout.

Loss (EAGLE): for each pair ``p`` of a buffered window, with prediction ``g_p`` and the target's
next feature ``f_{p+1}``::

    L = w_h * smooth_l1(g_p, f_{p+1})                                   (mean over H)
      + w_t * CE( softmax(head(f_{p+1})), log_softmax(head(g_p)) )      (soft labels)

where ``head = lm_head o final_norm`` are the target's current (frozen) weights. Optimizer: AdamW,
linear warm-up then constant learning rate (RL never "finishes", so there is nothing to decay to),
global-norm gradient clipping.

Preemption: :meth:`SpotTrainer.run` checks its stop condition before every micro-step, and keeps
at most one micro-step of GPU work in flight (it waits on the previous micro-step's CUDA event
before launching the next), so after the condition turns true it returns within about one
micro-step. A stop in the middle of a gradient-accumulation cycle drops the partial gradients
without touching the weights: the weights are always those after a whole optimizer step.
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Union

import torch
import torch.nn.functional as F

from .._validation import check_positive_ints
from .buffer import RolloutBuffer, TrainBatch
from .eagle import DrafterKVCache, EagleDrafter, accepted_length_greedy
from .weights import DrafterWeights, WeightsHolder

_CHECKPOINT_KEYS = ("drafter", "optimizer", "scheduler", "generator", "optimizer_steps", "micro_steps", "tokens_seen",
                    "version")
StopCondition = Union[None, Callable[[], bool], "threading.Event"]  # noqa: F821


def stop_check(stop: StopCondition) -> Optional[Callable[[], bool]]:
    """A run's stop condition as a callable: an object with ``is_set()`` (``threading.Event``), a callable, or None."""
    if stop is None:
        return None
    return stop.is_set if hasattr(stop, "is_set") else stop


def eagle_loss(drafter: EagleDrafter, batch: TrainBatch, hidden_weight: float = 1.0, token_weight: float = 0.1,
               feature_noise: float = 0.0, generator=None, feature_scale: Optional[torch.Tensor] = None,
               unroll_steps: int = 1):
    """EAGLE loss of one :class:`TrainBatch`; returns ``(loss, stats dict of floats-as-tensors)``.

    ``feature_noise`` adds ``U(-a, a)`` to the input features (EAGLE's robustness trick: at draft
    depth > 1 the drafter reads its own, imperfect, features). ``feature_scale`` (float32 ``[H]`` or None): the
    feature regression and the noise are taken per dimension in units of it -- a real model's last-layer features
    can hold a few dimensions thousands of times larger than the rest, which otherwise own the smooth-L1 term.
    ``unroll_steps``: the loss is the mean over draft depths ``1..unroll_steps`` of
    :meth:`EagleDrafter.forward_unrolled` (depth ``s`` reads its own predictions, as a draft does; 1 = EAGLE's
    teacher-forced loss). Stats: depth 1's losses and top-1 agreement, and the deepest depth's top-1.
    """
    f_in = batch.features[:, :-1]
    scale = feature_scale.to(f_in.device) if feature_scale is not None else None
    if feature_noise > 0:
        noise = torch.rand(f_in.shape, generator=generator, device="cpu" if generator is not None else f_in.device)
        noise = (noise.to(f_in.device) * 2 - 1) * feature_noise
        f_in = f_in + (noise * scale if scale is not None else noise)
    if unroll_steps == 1:
        preds = [drafter(f_in, batch.tokens[:, 1:], batch.positions[:, :-1])]
    else:
        preds = drafter.forward_unrolled(f_in, batch.tokens[:, 1:], batch.positions[:, :-1], steps=unroll_steps)
    tgt = batch.features[:, 1:]
    with torch.no_grad():
        p_tgt = torch.softmax(drafter.head_logits(tgt).float(), -1)
    loss, stats = 0.0, {}
    for depth, pred in enumerate(preds):
        m = batch.valid.to(torch.float32)
        m[:, :depth] = 0  # pairs before the depth have no draft there
        h_loss, t_loss, top1 = _depth_losses(drafter, pred, tgt, p_tgt, m, scale)
        loss = loss + (hidden_weight * h_loss + token_weight * t_loss) / len(preds)
        if depth == 0:
            stats.update(hidden_loss=h_loss.detach(), token_loss=t_loss.detach(), top1=top1)
    stats["top1_deepest"] = top1
    return loss, stats


def _depth_losses(drafter, pred, tgt, p_tgt, m, scale):
    """Feature regression, soft cross-entropy and top-1 agreement of one depth's predictions over the pairs ``m``."""
    denom = m.sum().clamp(min=1.0)
    pred_r, tgt_r = (pred.float(), tgt.float()) if scale is None else (pred.float() / scale, tgt.float() / scale)
    h_loss = (F.smooth_l1_loss(pred_r, tgt_r, reduction="none").mean(-1) * m).sum() / denom
    logq = torch.log_softmax(drafter.head_logits(pred).float(), -1)
    t_loss = (-(p_tgt * logq).sum(-1) * m).sum() / denom
    with torch.no_grad():
        top1 = ((logq.argmax(-1) == p_tgt.argmax(-1)).float() * m).sum() / denom
    return h_loss, t_loss, top1


@dataclass
class RunStats:
    """What one :meth:`SpotTrainer.run` call did."""

    micro_steps: int = 0
    optimizer_steps: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    stopped_by: str = ""  # "stop", "time_budget", "max_steps", "empty_buffer"
    last_loss: Optional[float] = None
    published_version: Optional[int] = None
    nonfinite_weights: bool = False  # a NaN/inf loss or gradient reached the weights: they were not published

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class SpotTrainer:
    """Trains an :class:`EagleDrafter` from a :class:`RolloutBuffer` in bounded, preemptible runs.

    Args:
        drafter: the module trained in place (keep the rollout's drafter a separate instance that
            loads published weights, or call :meth:`run` only while no decoding step runs).
        buffer: :class:`RolloutBuffer` of captured rollouts.
        holder: :class:`WeightsHolder` receiving published versions (created if None).
        lr, weight_decay, betas: AdamW settings; ``warmup_steps``: linear warm-up length.
        max_grad_norm: global-norm clipping (``None`` = off).
        batch_size, seq_len: windows per micro-step and pairs per window.
        grad_accum: micro-steps per optimizer step.
        hidden_weight, token_weight, feature_noise, unroll_steps: see :func:`eagle_loss`.
        normalize_hidden: regress features (and scale the noise) per dimension in units of their spread, a running
            estimate over the batches (:func:`eagle_loss`'s ``feature_scale``; :attr:`feature_scale`).
        autocast_dtype: autocast dtype on CUDA (``None`` = full precision); ignored on the CPU.
        process_group: when set (``torch.distributed``), gradients are averaged over its ranks
            before clipping (data-parallel training; see :mod:`tlt_kernels.drafter.distributed`).
        seed: seeds the sampling generator (offset by the rank when distributed).
    """

    in_process = True  # run() trains on the calling thread (the engine's session puts it on a low-priority stream)

    def __init__(
        self,
        drafter: EagleDrafter,
        buffer: RolloutBuffer,
        holder: Optional[WeightsHolder] = None,
        *,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas=(0.9, 0.95),
        warmup_steps: int = 50,
        max_grad_norm: Optional[float] = 0.5,
        batch_size: int = 8,
        seq_len: int = 256,
        grad_accum: int = 1,
        hidden_weight: float = 1.0,
        token_weight: float = 0.1,
        feature_noise: float = 0.0,
        unroll_steps: int = 1,
        normalize_hidden: bool = False,
        autocast_dtype: Optional[torch.dtype] = torch.bfloat16,
        process_group=None,
        seed: int = 0,
    ):
        check_positive_ints("SpotTrainer", grad_accum=grad_accum, batch_size=batch_size, seq_len=seq_len,
                            unroll_steps=unroll_steps)
        self.drafter = drafter
        self.buffer = buffer
        self.holder = holder if holder is not None else WeightsHolder()
        self.batch_size, self.seq_len, self.grad_accum = batch_size, seq_len, grad_accum
        self.hidden_weight, self.token_weight, self.feature_noise = hidden_weight, token_weight, feature_noise
        self.unroll_steps = unroll_steps
        self.normalize_hidden = normalize_hidden
        self.feature_scale: Optional[torch.Tensor] = None  # float32 [H], the running per-dimension spread
        self.max_grad_norm = max_grad_norm
        self.autocast_dtype = autocast_dtype
        self.process_group = process_group
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay)
        warm = max(1, warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm))
        self.device = next(drafter.parameters()).device
        self.rank = 0
        if process_group is not None:
            import torch.distributed as dist

            self.rank = dist.get_rank(process_group)
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed + 1_000_003 * self.rank)
        self.optimizer_steps = 0
        self.micro_steps = 0
        self.tokens_seen = 0
        self._accum = 0
        self._inflight: Optional[torch.cuda.Event] = None
        self.history: list = []  # (optimizer_step, loss) per optimizer step, for reporting

    # -- one micro-step --------------------------------------------------------------------------

    def micro_step(self) -> torch.Tensor:
        """Forward + backward of one batch; an optimizer step every ``grad_accum`` micro-steps.

        Returns the (device) loss tensor; never synchronizes except to bound in-flight work.
        """
        self.drafter.train()
        batch = self.buffer.sample(self.batch_size, self.seq_len, self.generator, device=self.device)
        if self.normalize_hidden:
            self._update_feature_scale(batch)
        loss = self._loss(batch, self.generator)
        (loss / self.grad_accum).backward()
        self._accum += 1
        self.micro_steps += 1
        self.tokens_seen += batch.valid.numel()
        if self._accum == self.grad_accum:
            self._optimizer_step()
        self._last_loss = loss.detach()
        return self._last_loss

    def _loss(self, batch: TrainBatch, generator: torch.Generator) -> torch.Tensor:
        """:func:`eagle_loss` of ``batch`` with this trainer's settings (autocast on CUDA when set)."""
        use_amp = self.device.type == "cuda" and self.autocast_dtype is not None
        with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16, enabled=use_amp):
            loss, _ = eagle_loss(self.drafter, batch, self.hidden_weight, self.token_weight, self.feature_noise,
                                 generator, self.feature_scale, self.unroll_steps)
        return loss

    def _on_device(self):
        """A context with the drafter's device current (Triton launches on the current device, and the in-flight
        events are recorded there); a no-op off CUDA."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def warm_up(self) -> None:
        """One forward and backward of the loss on a synthetic batch, its gradients then dropped: loads (on a cold
        cache, compiles) the training kernels before the first idle window, which would otherwise spend itself on
        them. Weights, optimizer, counters, feature scale and sampling state are left as they were."""
        if self._accum:
            raise RuntimeError("SpotTrainer.warm_up: called inside a gradient-accumulation cycle (its gradients "
                               "would be dropped); call it before training or after discard_partial()")
        B, S1, H = self.batch_size, self.seq_len + 1, self.drafter.config.hidden_size
        dev = self.device
        batch = TrainBatch(torch.zeros(B, S1, H, device=dev), torch.zeros(B, S1, dtype=torch.int64, device=dev),
                           torch.arange(S1, device=dev).expand(B, S1), torch.ones(B, S1 - 1, dtype=torch.bool, device=dev),
                           torch.zeros(B, dtype=torch.int64, device=dev))
        with self._on_device():
            self._loss(batch, torch.Generator()).backward()  # not self.generator: the sampling state stays
            for param in self.params:
                param.grad = None
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()

    @torch.no_grad()
    def _update_feature_scale(self, batch: TrainBatch, momentum: float = 0.99) -> None:
        """Running per-dimension standard deviation of the batches' target features (the first batch sets it), so
        the scale follows the target as RL moves it; floored so a constant dimension cannot divide by zero. Device
        ops only (no host read): a batch without two valid pairs leaves the scale as it was."""
        tgt, m = batch.features[:, 1:].float(), batch.valid.unsqueeze(-1).float()
        n = m.sum((0, 1))
        mean = (tgt * m).sum((0, 1)) / n.clamp(min=1.0)
        spread = (((tgt - mean) ** 2 * m).sum((0, 1)) / n.clamp(min=1.0)).sqrt().clamp(min=1e-3)
        previous = self.feature_scale
        if previous is None:
            self.feature_scale = torch.where(n > 1, spread, torch.ones_like(spread))
        else:
            self.feature_scale = torch.where(n > 1, previous * momentum + spread * (1 - momentum), previous)

    def _optimizer_step(self) -> None:
        if self.process_group is not None:
            from .distributed import allreduce_gradients_

            allreduce_gradients_(self.params, self.process_group)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._accum = 0
        self.optimizer_steps += 1

    def discard_partial(self) -> None:
        """Drop gradients of an unfinished accumulation cycle (weights are untouched)."""
        if self._accum:
            self.optimizer.zero_grad(set_to_none=True)
            self._accum = 0

    # -- preemptible run -------------------------------------------------------------------------

    def run(
        self,
        stop: StopCondition = None,
        time_budget_s: Optional[float] = None,
        max_steps: Optional[int] = None,
        publish: bool = True,
    ) -> RunStats:
        """Train until ``stop`` is true, ``time_budget_s`` has passed or ``max_steps`` optimizer steps.

        Args:
            stop: ``callable() -> bool`` or an object with ``is_set()`` (``threading.Event``);
                polled before every micro-step.
            time_budget_s: wall-clock budget of this call.
            max_steps: optimizer steps of this call.
            publish: publish the weights to ``holder`` at the end when any optimizer step ran.

        Returns:
            :class:`RunStats`. On return, no training kernel is in flight and the weights are those
            after the last whole optimizer step.
        """
        t0 = time.perf_counter()
        deadline = None if time_budget_s is None else t0 + time_budget_s
        check = stop_check(stop)
        stats = RunStats()
        steps0, micro0, tok0 = self.optimizer_steps, self.micro_steps, self.tokens_seen
        with self._on_device():
            while True:
                stats.stopped_by = self._stop_reason(check, deadline, max_steps, steps0)
                if stats.stopped_by:
                    break
                self.micro_step()
                self._bound_inflight()
            self.discard_partial()
            self._drain_inflight()
        stats.micro_steps = self.micro_steps - micro0
        stats.optimizer_steps = self.optimizer_steps - steps0
        stats.tokens = self.tokens_seen - tok0
        if stats.micro_steps:
            stats.last_loss = float(self._last_loss)
            self.history.append((self.optimizer_steps, stats.last_loss))
        if publish and stats.optimizer_steps:
            self._publish_if_finite(stats)
        stats.elapsed_s = time.perf_counter() - t0
        return stats

    def _stop_reason(self, check, deadline: Optional[float], max_steps: Optional[int], steps0: int) -> str:
        """Why :meth:`run` stops before the next micro-step (a :attr:`RunStats.stopped_by` value), or "" to go on."""
        if check is not None and check():
            return "stop"
        if deadline is not None and time.perf_counter() >= deadline:
            return "time_budget"
        if max_steps is not None and self.optimizer_steps - steps0 >= max_steps and self._accum == 0:
            return "max_steps"
        if self.buffer.num_tokens == 0:
            return "empty_buffer"
        return ""

    def _bound_inflight(self) -> None:
        """On CUDA, bounds the queue to one micro-step so a stop is honoured within about one micro-step."""
        if self.device.type != "cuda":
            return
        if self._inflight is not None:
            self._inflight.synchronize()
        self._inflight = torch.cuda.Event()
        self._inflight.record()

    def _drain_inflight(self) -> None:
        """On CUDA, waits for every queued training kernel."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            self._inflight = None

    def _publish_if_finite(self, stats: RunStats) -> None:
        """Publishes the weights (recording the version in ``stats``) unless one is not finite (then warns)."""
        # One check per run (the run has synchronized already): a rollout drafter with NaN weights would
        # draft garbage, and the acceptance, not the output, would drop silently.
        if bool(torch.stack([torch.isfinite(p).all() for p in self.params]).all()):
            stats.published_version = self.publish().version
        else:
            stats.nonfinite_weights = True
            # stacklevel 3: the warning points at run's caller.
            warnings.warn(f"SpotTrainer.run: the drafter's weights are no longer finite after optimizer step "
                          f"{self.optimizer_steps} (loss {stats.last_loss}); not published, the rollout keeps "
                          f"version {self.holder.version}", RuntimeWarning, stacklevel=3)

    def refresh_head(self, source: EagleDrafter) -> None:
        """After a policy update: a replica's copy of the target's embedding, head and final norm follows
        ``source``'s (:meth:`EagleDrafter.copy_shared_from`); a drafter that reads the target's own is left alone."""
        if self.drafter.shared_modules != source.shared_modules:
            self.drafter.copy_shared_from(source)

    def publish(self) -> DrafterWeights:
        """Snapshot the drafter's weights into ``holder`` as a new version."""
        w = self.holder.publish(self.drafter.state_dict())
        self.drafter.weights_version = w.version
        return w

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> Dict:
        return {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "optimizer_steps": self.optimizer_steps,
            "micro_steps": self.micro_steps,
            "tokens_seen": self.tokens_seen,
            "version": self.holder.version,
        }

    def load_state_dict(self, state: Dict) -> None:
        self.discard_partial()
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        self.optimizer_steps = state["optimizer_steps"]
        self.micro_steps = state["micro_steps"]
        self.tokens_seen = state["tokens_seen"]
        if state["version"] > self.holder.version:
            self.holder.publish(self.drafter.state_dict(), version=state["version"])
        self.drafter.weights_version = state["version"]

    def save_checkpoint(self, path: str) -> None:
        """Write atomically (temp file + rename): a preemption mid-save leaves the previous file."""
        self.discard_partial()
        tmp = f"{path}.tmp.{os.getpid()}"
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)

    def load_checkpoint(self, path: str) -> None:
        """Load a file written by :meth:`save_checkpoint`; an unreadable file or one without the trainer's keys
        raises ValueError naming it."""
        try:
            state = torch.load(path, map_location=self.device, weights_only=False)
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            raise
        except Exception as exc:  # torch.load raises pickle, zip and EOF errors of many types for a corrupt file
            raise ValueError(f"{path} is not a readable SpotTrainer checkpoint: {type(exc).__name__}: {exc}") from exc
        missing = [k for k in _CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
        if missing:
            raise ValueError(f"{path} is not a SpotTrainer checkpoint: missing {missing}")
        self.load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# Drafter quality
# ---------------------------------------------------------------------------------------------


@dataclass
class DrafterQuality:
    """Tracks the drafter's mean accepted length (drafts accepted + 1) so the selector can prefer
    n-gram or no speculation while it is weak.

    ``record`` takes accepted lengths observed in live rollouts (or from
    :func:`evaluate_acceptance` on held-out rollouts); the estimate is an exponential moving
    average of per-call means, reset per weights version in ``by_version``.
    """

    ema: float = 0.8
    weak_below: float = 1.5
    value: Optional[float] = None
    by_version: Dict[int, float] = field(default_factory=dict)
    rejected: int = 0  # calls ignored: no lengths, or a NaN / infinite / negative one (a RuntimeWarning the first time)
    _warned: bool = field(default=False, repr=False)

    def record(self, accepted_lengths, version: int = 0) -> Optional[float]:
        """Fold in one call's accepted lengths; returns the estimate. A call with no lengths, or with a NaN, infinite
        or negative one, is ignored and counted in :attr:`rejected`: one NaN would stick in the moving average and
        make :attr:`is_weak` False for good."""
        t = torch.as_tensor(accepted_lengths, dtype=torch.float64)
        if t.numel() == 0 or not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            self.rejected += 1
            if not self._warned:
                self._warned = True
                warnings.warn(f"DrafterQuality.record ignored accepted_lengths={t.tolist()[:8]} (empty, NaN, infinite or "
                              "negative); later ones are ignored silently and counted in DrafterQuality.rejected",
                              RuntimeWarning, stacklevel=2)
            return self.value
        x = float(t.mean())
        self.value = x if self.value is None else self.ema * self.value + (1 - self.ema) * x
        self.by_version[version] = x if version not in self.by_version else self.ema * self.by_version[version] + (1 - self.ema) * x
        return self.value

    @property
    def is_weak(self) -> bool:
        return self.value is None or self.value < self.weak_below


@torch.no_grad()
def evaluate_acceptance(
    drafter: EagleDrafter,
    features: torch.Tensor,
    tokens: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    *,
    depth: int = 4,
    topk: int = 4,
    num_verify: int = 16,
    num_starts: int = 8,
    block_size: int = 16,
) -> float:
    """Mean accepted length of the drafter's trees on held-out *greedy* rollouts.

    For each sequence and ``num_starts`` evenly spaced roots ``p``, the drafter's cache is filled
    with the true pairs ``0..p-1``, a tree is drafted below ``tokens[p]`` and verified against the
    rollout's own continuation (exact for greedy rollouts: the continuation is the target's argmax).

    Args:
        features: ``[B, L, H]`` target features of the rollouts; ``tokens``: ``int64 [B, L]``.
        lengths: ``int [B]`` valid positions (default ``L``).

    Returns:
        mean accepted length (``1`` = nothing accepted, at most ``depth + 1``).
    """
    check_positive_ints("evaluate_acceptance", depth=depth, topk=topk, num_verify=num_verify, num_starts=num_starts,
                   block_size=block_size)
    was_training = drafter.training
    drafter.eval()
    B, L, H = features.shape
    dev = next(drafter.parameters()).device
    lens = [L] * B if lengths is None else [int(v) for v in lengths.tolist()]
    rows = []
    for b in range(B):
        hi = lens[b] - depth - 1
        if hi < 1:
            continue
        starts = torch.linspace(1, hi, min(num_starts, hi)).round().long().unique().tolist()
        rows += [(b, p) for p in starts]
    if not rows:
        raise ValueError(f"evaluate_acceptance: no sequence is longer than depth + 2 = {depth + 2}")
    P = max(p for _, p in rows)
    R = len(rows)
    feats = torch.zeros(R, P, H, dtype=features.dtype, device=dev)
    nxt = torch.zeros(R, P, dtype=torch.int64, device=dev)
    cont = torch.zeros(R, depth, dtype=torch.int64, device=dev)
    for r, (b, p) in enumerate(rows):
        feats[r, :p] = features[b, :p]
        nxt[r, :p] = tokens[b, 1 : p + 1]
        cont[r] = tokens[b, p + 1 : p + 1 + depth]
    num_new = torch.tensor([p for _, p in rows], dtype=torch.int32, device=dev)
    nb = 1 + R * drafter.blocks_per_request(P, block_size)
    cache = DrafterKVCache(drafter.config, nb, block_size, device=dev, dtype=next(drafter.parameters()).dtype)
    state = drafter.new_state(cache, R, P)
    drafter.prefill(state, cache, feats, nxt, num_new)
    tree = drafter.draft(state, cache, depth, topk, num_verify).tree
    acc = accepted_length_greedy(tree.parents, tree.draft_tokens, tree.num_nodes, cont)
    drafter.train(was_training)
    return float(acc.float().mean())
