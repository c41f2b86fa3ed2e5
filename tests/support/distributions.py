"""Draft distributions written by hand."""

import torch
from specdec.common.sampling import SparseDistribution


def one_hot(token: int) -> SparseDistribution:
    return SparseDistribution(torch.tensor([token]), torch.tensor([1.0]))
