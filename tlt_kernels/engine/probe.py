"""Arm probing and cost measurement: every strategy timed on the live batch (a trace record for the simulator) or on
padding rows of its captured graphs (the cost selector's start-up table)."""
from __future__ import annotations

import time

import torch


def synced_seconds(device: torch.device, fn):
    """``(seconds, fn())``: wall time between device synchronizations, so queued GPU work and launch costs are in."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started, out


def replay_seconds(device: torch.device, replay, repeats: int) -> float:
    """The upper median of ``repeats`` timed calls of ``replay()`` (:func:`synced_seconds` each), after a first call
    not counted (it warms up): a captured graph's time on its padding rows."""
    times = [synced_seconds(device, replay)[0] for _ in range(repeats + 1)]
    times = sorted(times[1:])
    return max(times[len(times) // 2], 1e-9)


def probe_arms(runner, strategies, covers, inputs, device: torch.device, lagging=None) -> dict:
    """One trace record (:func:`tlt_kernels.runtime.simulate.load_trace`'s format): every strategy that ``covers``
    the batch drafted, verified and accepted on the live rows without committing. ``lagging`` (bool ``[b]``, the
    rows with the most tokens left, the ones a static batch waits for) adds each arm's ``lagging_rows`` and
    ``lagging_accepted`` (how many of them reached each draft depth): what the engine's selector learns from. With
    an n-gram drafter the record also counts the rows that have a draft (``drafted_rows``, ``lagging_drafted_rows``:
    :func:`drafted_rows`).

    Only cache slots past each request's context are written (tree nodes, then their compaction; the drafter's
    too), and the real step rewrites them before anything reads them. A fused runner replays each strategy's step
    graph, so the recorded step times are those of the real steps; a drafter whose fused commit writes in place
    (``snapshot``, optional) gets its state back after each probe."""
    batch_size = inputs.batch_size
    record = {"batch_size": batch_size, "arms": arms_of_step(runner, strategies, covers, inputs, device, lagging)}
    drafted = drafted_rows(runner.drafter, inputs, lagging)
    if drafted is not None:
        record["drafted_rows"] = drafted[0]
        if lagging is not None:
            record["lagging_drafted_rows"] = drafted[1]
    return record


def drafted_rows(drafter, inputs, lagging=None):
    """``[rows with a draft, lagging rows with one]`` (the first alone without ``lagging``) of an n-gram drafter's
    step: the rows whose history holds a match of its suffix (their own, or a sibling's with groups), so every
    speculative arm drafts at least one token for them and none for the others; None for any other drafter (a model
    always drafts). Read after a device synchronization, outside the timed probes: a selector that knew it before
    choosing could skip a step with nothing to verify (docs/RUNTIME.md)."""
    from ..drafter.ngram_rollout import NGramRolloutDrafter

    if not isinstance(drafter, NGramRolloutDrafter) or drafter.histories is None:
        return None
    history_rows = inputs.drafter_state[0] if inputs.drafter_state else inputs.rows
    has_draft = drafter.histories.propose(1).num_drafts[history_rows] > 0
    counts = [has_draft.sum()] + ([] if lagging is None else [(has_draft & lagging).sum()])
    return torch.stack(counts).tolist()


def arms_of_step(runner, strategies, covers, inputs, device: torch.device, lagging=None) -> dict:
    """:func:`probe_arms`' ``arms`` map: each covered strategy's step time, emitted tokens and acceptance counts."""
    batch_size = inputs.batch_size
    snapshot = getattr(runner.drafter, "snapshot", None)
    arms = {}
    for strategy in strategies:
        if not covers(strategy, batch_size):
            continue
        restore = snapshot() if snapshot is not None else None

        def probe(strategy=strategy):
            num_accepted = runner.run(strategy, inputs).num_accepted.to(torch.int64)
            reached = [num_accepted > j for j in range(strategy.num_steps)]
            counts = [(num_accepted + 1).sum().view(1)] + [r.sum().view(1) for r in reached]
            if lagging is not None:
                counts += [lagging.sum().view(1)] + [(r & lagging).sum().view(1) for r in reached]
            return torch.cat(counts).tolist()

        seconds, host = synced_seconds(device, probe)
        if restore is not None:
            restore()
        depth = strategy.num_steps
        arms[str(strategy)] = {"step_time": seconds, "emitted": host[0], "accepted": host[1:1 + depth]}
        if lagging is not None:
            arms[str(strategy)].update(lagging_rows=host[1 + depth], lagging_accepted=host[2 + depth:])
    return arms


def measure_cost_table(pool, runner, strategies, device: torch.device, batch_sizes, repeats: int):
    """Median step time of every strategy at every batch size its graphs cover, replaying the step's graphs on
    padding rows (see :meth:`~tlt_kernels.engine.SpeculativeEngine.measure_cost_table`). Returns a CostTable."""
    from ..runtime.policies import CostTable

    table = {}
    for strategy in strategies:
        names = runner.graph_names(strategy)
        points = []
        for batch_size in batch_sizes or pool.captured_sizes(names[0]):
            if not all(pool.covers(name, batch_size) for name in names):
                continue

            def replay(names=names, batch_size=batch_size):
                for name in names:
                    pool.replay_padding(name, batch_size)

            points.append((batch_size, replay_seconds(device, replay, repeats)))
        if points:
            table[strategy] = points
    if not table:
        raise ValueError("no strategy has a captured graph at the requested batch sizes")
    return CostTable(table)
