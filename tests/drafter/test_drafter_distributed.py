"""Data-parallel drafter training and weight broadcast over torch.distributed.

CPU: two gloo processes. GPU (nvidia-h100-x2): the same worker over NCCL, one GPU per rank.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tlt_kernels.drafter import EagleDrafter, RolloutBuffer, SpotTrainer, WeightsHolder
from tlt_kernels.drafter.distributed import allreduce_gradients_, broadcast_weights


def _worker(rank, world, init_file, backend, out_dir):
    torch.set_num_threads(1)
    dev = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from test_spot_trainer import PermutationTarget

        tgt = PermutationTarget(seed=0).to(dev)
        torch.manual_seed(0)  # identical drafter initialisation on every rank
        d = EagleDrafter.for_target(tgt, intermediate_size=64)
        # 1) gradient averaging: rank r holds gradient r + 1 -> mean 1.5 everywhere.
        params = list(d.parameters())
        for p in params:
            p.grad = torch.full_like(p, float(rank + 1))
        allreduce_gradients_(params)
        assert all(torch.all(p.grad == 1.5) for p in params)
        for p in params:
            p.grad = None
        # 2) a data-parallel step on different data keeps the replicas identical.
        buf = RolloutBuffer(4096)
        toks, feats = tgt.rollout(torch.arange(8, device=dev) * (rank + 1) % 32, 20)
        buf.add(feats, toks, step=0)
        tr = SpotTrainer(d, buf, lr=1e-2, warmup_steps=1, batch_size=4, seq_len=8, process_group=dist.group.WORLD)
        tr.run(max_steps=2, publish=False)
        flat = torch.cat([p.detach().reshape(-1) for p in d.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert torch.equal(gathered[0], gathered[1]), "replicas diverged"
        init = EagleDrafter.for_target(tgt, intermediate_size=64)
        assert not torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in init.parameters()]))
        # 3) broadcast of a new version from the trainer (rank 0) to a rollout rank (rank 1).
        holder = WeightsHolder()
        if rank == 0:
            with torch.no_grad():
                d.fc.weight.add_(1.0)  # make the sent version differ from rank 1's replica
            w = holder.publish(d.state_dict(), version=7)
        else:
            w = None
        got = broadcast_weights(w, d.state_dict(), src=0, holder=holder)
        assert got.version == 7 and holder.version == 7
        rollout = EagleDrafter.for_target(tgt, intermediate_size=64)
        assert rollout.maybe_update(holder) and rollout.weights_version == 7
        flat_sent = torch.cat([v.reshape(-1) for v in got.state_dict.values()])
        ref = [torch.empty_like(flat_sent) for _ in range(world)]
        dist.all_gather(ref, flat_sent)
        assert torch.equal(ref[0], ref[1])
        if rank == 1:
            assert torch.equal(rollout.fc.weight, gathered[0][: d.fc.weight.numel()].view_as(d.fc.weight) + 1.0)
        open(os.path.join(out_dir, f"ok{rank}"), "w").close()
    finally:
        dist.destroy_process_group()


def _run(backend, tmp_path):
    init_file = str(tmp_path / "init")
    # fork skips re-importing torch in the children (seconds on a loaded CI box); a process that has
    # touched CUDA (any GPU machine: the harness and conftest query it) must spawn instead.
    method = "spawn" if backend == "nccl" or torch.cuda.is_available() else "fork"
    mp.start_processes(_worker, args=(2, init_file, backend, str(tmp_path)), nprocs=2, join=True, start_method=method)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def test_data_parallel_and_broadcast_gloo(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    _run("gloo", tmp_path)


@pytest.mark.cuda
def test_data_parallel_and_broadcast_nccl(tmp_path):
    if torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip("needs 2 GPUs and NCCL")
    _run("nccl", tmp_path)
