"""The SDE window (megaflow.flow.window): drawn windows cover their range uniformly, and bad windows are
refused with the settings' names. Needs: CPU, 1 process."""
import pytest
import torch

from megaflow.flow.window import check_sde_window, sample_sde_window


def test_sample_sde_window_covers_range_uniformly():
    g = torch.Generator().manual_seed(0)
    starts = [sample_sde_window(10, 2, window_range=(0, 5), generator=g)[0] for _ in range(400)]
    assert set(starts) == {0, 1, 2, 3}
    w = sample_sde_window(10, 3, generator=g)
    assert w == list(range(w[0], w[0] + 3)) and 0 <= w[0] <= 7
    with pytest.raises(ValueError):
        sample_sde_window(10, 6, window_range=(0, 5))
    with pytest.raises(ValueError, match="window_size must be in"):
        check_sde_window(num_steps=10, window=(), window_size=6, window_range=(0, 5), sde_type="sde")
    assert check_sde_window(num_steps=10, window=[1, 2], window_size=0, window_range=(), sde_type="sde") is None
