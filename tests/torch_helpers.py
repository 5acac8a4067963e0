"""Small torch modules shared by the capture and executor tests."""

from __future__ import annotations

import torch


class Branchy(torch.nn.Module):
    """Data-dependent control flow (a branch on a tensor value): export must refuse it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if y.sum() > 0:
            return y * 2
        return y
