"""Per-request sampling parameters of a rollout, on the device, in the two forms a step takes them."""
from __future__ import annotations

import torch


def per_request(name: str, value, dtype: torch.dtype, batch_size: int, device: torch.device):
    """``value`` (None, a scalar or one entry per request) as a ``dtype [batch_size]`` device tensor (None stays None)."""
    if value is None:
        return None
    values = torch.as_tensor(value, dtype=dtype).flatten()
    if values.numel() == 1:
        values = values.expand(batch_size).clone()
    if values.numel() != batch_size:
        raise ValueError(f"{name} must be a scalar or have one entry per request ({batch_size}), got {values.numel()}")
    return values.to(device)


class RequestSampling:
    """Temperature (float32 ``[B]``, 0 = greedy), top-k (int32 ``[B]`` or None), top-p (float32 ``[B]`` or None)
    and Philox seeds (int64 ``[B]``) of a rollout's ``B`` requests."""

    def __init__(self, batch_size: int, device: torch.device, temperature, top_k, top_p, seed):
        self.temperature = per_request("temperature", temperature, torch.float32, batch_size, device)
        self.greedy = bool((self.temperature == 0).all())
        self.top_k = per_request("top_k", top_k, torch.int32, batch_size, device)
        self.top_p = per_request("top_p", top_p, torch.float32, batch_size, device)
        self.seeds = per_request("seed", seed, torch.int64, batch_size, device)
        # The fused step graph always takes tensors: temperature 0 = greedy, top_k 0 and top_p 1 = off.
        self.top_k_or_off = self.top_k if self.top_k is not None else torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.top_p_or_off = self.top_p if self.top_p is not None else torch.ones(batch_size, dtype=torch.float32, device=device)
        # The running rows change only when requests finish: their parameters are gathered once per set of rows.
        self._rows, self._row_params = None, None

    def verify_kwargs(self, rows: torch.Tensor, offsets: torch.Tensor) -> dict:
        """:func:`~tlt_kernels.verify_tree`'s sampling arguments for ``rows`` (int64 ``[b]``) at counter ``offsets``
        (int64 ``[B]``)."""
        pick = (lambda values: None if values is None else values[rows])
        return dict(temperature=None if self.greedy else self.temperature[rows], top_k=pick(self.top_k),
                    top_p=pick(self.top_p), seed=self.seeds[rows], offset=offsets[rows])

    def graph_inputs(self, rows: torch.Tensor, offsets: torch.Tensor) -> tuple:
        """The fused step graph's sampling inputs for ``rows``: (temperature, top_k, top_p, seed, offset)."""
        if self._rows is not rows:  # the same tensor object until a request finishes (RolloutState.active_on_device)
            self._rows = rows
            self._row_params = (self.temperature[rows], self.top_k_or_off[rows], self.top_p_or_off[rows],
                                self.seeds[rows])
        return (*self._row_params, offsets[rows])
