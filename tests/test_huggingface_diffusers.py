"""Diffusers on tpu: a tiny randomly initialised UNet pipeline (DDPMPipeline, with attention blocks)
runs its whole denoising loop on tpu with the DDPM and the DDIM scheduler, and the images match the
same pipeline on CPU (same CPU generator, so the same noise)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")


def _unet():
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8, attention_head_dim=8).eval()


@pytest.mark.heavy  # the UNet's convolutions compile once (~20 s on a quiet machine), then 10 steps
@pytest.mark.parametrize("scheduler", ["DDPMScheduler", "DDIMScheduler"])
def test_unet_pipeline_denoising_loop_matches_cpu(scheduler):
    pipe = diffusers.DDPMPipeline(unet=_unet(), scheduler=getattr(diffusers, scheduler)(num_train_timesteps=50))
    pipe.set_progress_bar_config(disable=True)

    def images():
        return pipe(batch_size=2, num_inference_steps=5, generator=torch.Generator().manual_seed(0),
                    output_type="np").images

    expected = images()
    pipe.to("tpu")
    assert pipe.device.type == "tpu"
    got = images()
    assert got.shape == expected.shape == (2, 8, 8, 3)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert np.abs(expected - 0.5).max() > 0.01  # a real image, not a constant
