"""Bitwise comparison of tensors for the tests: same shape, same dtype, the same bits (NaN patterns included)."""
import torch


def bits(x: torch.Tensor) -> torch.Tensor:
    """x's bit patterns as an integer tensor of the same element size (16- or 32-bit floats)."""
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


def same_bits(a, b) -> bool:
    """True when a and b (tensors, or sequences of tensors) hold the same shapes, dtypes and bits."""
    a, b = (list(v) if isinstance(v, (tuple, list)) else [v] for v in (a, b))
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Raises with the number of differing elements and the first one's index."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if not torch.equal(bits(a), bits(b)):
        bad = (bits(a) != bits(b)).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}")
