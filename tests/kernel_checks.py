"""Comparison helpers and the poisoned-margin tensor guard shared by the kernel tests (tests/test_kernels.py,
tests/test_graph_safe.py)."""
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64 on the CPU (any shapes that broadcast equal). AssertionError when a has non-finite
    values (a kernel that read poison or overflowed)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values in kernel output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality with NaN == NaN (poisoned pool regions must stay poisoned)."""
    return torch.equal(torch.nan_to_num(a.cpu().float(), nan=1234.5), torch.nan_to_num(b.cpu().float(), nan=1234.5))


class Guarded:
    """Poisoned memory around every tensor a kernel gets: `g(t)` copies t into the middle of a buffer whose PAD
    elements on each side hold poison (NaN for floats, -1 / 0xFF for integers) and returns that view. An
    out-of-bounds read picks up poison (NaN outputs, or a bad index that faults); `g.check()` asserts no margin
    was written (out-of-bounds stores)."""

    PAD = 256

    def __init__(self):
        self.bufs = []

    @staticmethod
    def _poison(dtype):
        return float("nan") if dtype.is_floating_point else (0xFF if dtype == torch.uint8 else -1)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        buf = torch.full((t.numel() + 2 * self.PAD,), self._poison(t.dtype), dtype=t.dtype, device=t.device)
        view = buf[self.PAD:self.PAD + t.numel()].view(t.shape)
        view.copy_(t)
        self.bufs.append(buf)
        return view

    def empty(self, *shape, dtype, device=DEV) -> torch.Tensor:
        return self(torch.zeros(*shape, dtype=dtype, device=device))

    def check(self):
        for buf in self.bufs:
            for margin in (buf[:self.PAD], buf[-self.PAD:]):
                if buf.dtype.is_floating_point:
                    assert torch.isnan(margin.float()).all(), "a kernel wrote outside its tensor"
                else:
                    assert (margin == self._poison(buf.dtype)).all(), "a kernel wrote outside its tensor"
