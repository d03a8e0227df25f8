"""Comparison helpers shared by the kernel tests (tests/test_kernels.py, tests/test_graph_safe.py)."""
import torch


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64 on the CPU (any shapes that broadcast equal). AssertionError when a has non-finite
    values (a kernel that read poison or overflowed)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values in kernel output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality with NaN == NaN (poisoned pool regions must stay poisoned)."""
    return torch.equal(torch.nan_to_num(a.cpu().float(), nan=1234.5), torch.nan_to_num(b.cpu().float(), nan=1234.5))
