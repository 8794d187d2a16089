"""Request groups of a rollout (GRPO's ``G`` responses to one prompt) as the drafter's sibling table."""
from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch


def sibling_table(groups: Optional[Sequence[Hashable]], batch_size: int, device) -> Optional[torch.Tensor]:
    """``int64 [B, S]``: row ``b`` lists the other requests of its group in request order, -1 padded to the largest
    group's size less one (``S = 0`` when every group is a single request). ``groups``: one hashable id per request
    (None: no groups, returns None). Built on the host once per rollout."""
    if groups is None:
        return None
    if isinstance(groups, (str, bytes)) or len(groups) != batch_size:
        raise ValueError(f"groups must hold one group id per request ({batch_size}), got {groups!r}")
    members = {}
    for row, group in enumerate(groups):
        members.setdefault(group, []).append(row)
    width = max(len(rows) for rows in members.values()) - 1 if members else 0
    table = torch.full((batch_size, width), -1, dtype=torch.int64)
    for rows in members.values():
        for row in rows:
            others = [r for r in rows if r != row]
            table[row, : len(others)] = torch.tensor(others, dtype=torch.int64)
    return table.to(device)
