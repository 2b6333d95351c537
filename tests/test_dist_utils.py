import pytest
import torch
import torch.distributed as dist
from dist_utils import DistributedTestError, run_distributed


def _all_reduce_rank() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def test_results_in_rank_order():
    assert run_distributed(_all_reduce_rank, 3) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def test_failure_reports_rank_traceback():
    with pytest.raises(DistributedTestError, match="rank 1 failed(.|\n)*boom on rank one"):
        run_distributed(_fail_on_rank_one, 2, timeout=300)
