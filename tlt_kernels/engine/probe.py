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


def probe_arms(runner, strategies, covers, inputs, device: torch.device, lagging=None) -> dict:
    """One trace record (:func:`tlt_kernels.runtime.simulate.load_trace`'s format): every strategy that ``covers``
    the batch drafted, verified and accepted on the live rows without committing. ``lagging`` (bool ``[b]``, the
    rows with the most tokens left, the ones a static batch waits for) adds each arm's ``lagging_rows`` and
    ``lagging_accepted`` (how many of them reached each draft depth): what the engine's selector learns from.

    Only cache slots past each request's context are written (tree nodes, then their compaction; the drafter's
    too), and the real step rewrites them before anything reads them. A fused runner replays each strategy's step
    graph, so the recorded step times are those of the real steps; a drafter whose fused commit writes in place
    (``snapshot``, optional) gets its state back after each probe."""
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
    return {"batch_size": batch_size, "arms": arms}


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

            times = [synced_seconds(device, replay)[0] for _ in range(repeats + 1)]
            times = sorted(times[1:])  # the first replay warms up
            points.append((batch_size, max(times[len(times) // 2], 1e-9)))
        if points:
            table[strategy] = points
    if not table:
        raise ValueError("no strategy has a captured graph at the requested batch sizes")
    return CostTable(table)
