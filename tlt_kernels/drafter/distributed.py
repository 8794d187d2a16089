"""Scale-out: data-parallel drafter training and broadcast of new weights to rollout ranks.

Layout: the world group holds every rank; the *trainer group* (``torch.distributed.new_group``) is
the ranks that train the drafter in their idle windows. Each trainer rank samples its own batches
(:class:`SpotTrainer` seeds by rank) and :func:`allreduce_gradients_` averages the gradients before
clipping, so all trainer ranks apply the same update and stay bit-identical. A new version is then
sent from one trainer rank to everyone with :func:`broadcast_weights` (one flat buffer, one
collective), and rollout ranks install it into their :class:`WeightsHolder`.

Backends: NCCL on GPUs (tensors must be CUDA tensors), gloo on the CPU (tests).
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch
import torch.distributed as dist

from .weights import DrafterWeights, WeightsHolder


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else None


def allreduce_gradients_(params: Iterable[torch.nn.Parameter], group=None) -> None:
    """Average ``p.grad`` over the ranks of ``group`` in place (one flattened all-reduce per dtype).

    A parameter without a gradient on this rank contributes zeros, so every rank takes part in
    the same collective whatever its batch touched.
    """
    params = [p for p in params if p.requires_grad]
    world = dist.get_world_size(group)
    by_dtype: Dict[torch.dtype, list] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for ps in by_dtype.values():
        flat = _flat([p.grad for p in ps])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(world)
        i = 0
        for p in ps:
            n = p.grad.numel()
            p.grad.copy_(flat[i : i + n].view_as(p.grad))
            i += n


def broadcast_weights(
    weights: Optional[DrafterWeights],
    template: Dict[str, torch.Tensor],
    src: int,
    group=None,
    holder: Optional[WeightsHolder] = None,
) -> DrafterWeights:
    """Send ``weights`` from global rank ``src`` to every rank of ``group``.

    Args:
        weights: the version to send (used on ``src`` only; may be None elsewhere).
        template: a ``state_dict`` with the right names, shapes, dtypes and device (e.g. the local
            drafter's): received tensors are allocated like it.
        src: global rank that sends.
        group: process group (default: the world).
        holder: when given, the received version is installed with :meth:`WeightsHolder.put`.

    Returns:
        the :class:`DrafterWeights` every rank now holds (same version everywhere).
    """
    rank = dist.get_rank()
    names = list(template)
    dev = next(iter(template.values())).device
    version = torch.tensor([weights.version if rank == src else -1], dtype=torch.int64, device=dev)
    dist.broadcast(version, src=src, group=group)
    out: Dict[str, torch.Tensor] = {}
    by_dtype: Dict[torch.dtype, list] = {}
    for n in names:
        by_dtype.setdefault(template[n].dtype, []).append(n)
    for dtype, ns in by_dtype.items():
        if rank == src:
            flat = _flat([weights.state_dict[n].to(device=dev, dtype=dtype) for n in ns])
        else:
            flat = torch.empty(sum(template[n].numel() for n in ns), dtype=dtype, device=dev)
        dist.broadcast(flat, src=src, group=group)
        i = 0
        for n in ns:
            k = template[n].numel()
            out[n] = flat[i : i + k].view_as(template[n]).clone()
            i += k
    received = DrafterWeights(int(version.item()), {n: out[n] for n in names})
    if holder is not None:
        holder.put(received)
    return received
