"""Forward seeding: the same draws for the same (seed, step, piece, micro-batch), the caller's stream untouched."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pipeloom.runtime.step.rng import forward_seed, seeded


def test_seeded_draws_from_the_forward_seed_and_restores_the_callers_generator():
    torch.manual_seed(7)
    expected_after = torch.rand(3)
    torch.manual_seed(7)
    with seeded(1, 2, 3, 4, torch.device("cpu")):
        inside = torch.rand(5)
    assert torch.equal(torch.rand(3), expected_after)  # the caller's stream continues as if nothing ran
    assert torch.equal(inside, torch.rand(5, generator=torch.Generator().manual_seed(forward_seed(1, 2, 3, 4))))
    with seeded(1, 2, 3, 5, torch.device("cpu")):
        assert not torch.equal(torch.rand(5), inside)


def test_seeded_restores_the_generator_when_the_block_raises():
    torch.manual_seed(11)
    expected = torch.rand(2)
    torch.manual_seed(11)
    with pytest.raises(ValueError), seeded(0, 0, 0, 0, torch.device("cpu")):
        torch.rand(100)
        raise ValueError("inside a forward")
    assert torch.equal(torch.rand(2), expected)
