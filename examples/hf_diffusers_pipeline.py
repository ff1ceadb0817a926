"""A Diffusers pipeline on "tpu": a tiny random UNet with a DDIM scheduler denoises on tpu.

    python examples/hf_diffusers_pipeline.py [--steps 10]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch


def main():
    from diffusers import DDIMScheduler, DDPMPipeline, UNet2DModel

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10, help="denoising steps")
    steps = parser.parse_args().steps
    torch.manual_seed(0)
    unet = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8, attention_head_dim=8)
    pipe = DDPMPipeline(unet=unet, scheduler=DDIMScheduler(num_train_timesteps=100)).to("tpu")
    pipe.set_progress_bar_config(disable=True)
    images = pipe(batch_size=2, num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                  output_type="np").images
    print(f"pipeline on {pipe.device}: images {images.shape}, mean {images.mean():.3f}")
    cpu = pipe.to("cpu")(batch_size=2, num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                         output_type="np").images
    # tpu multiplies float32 in bf16 by default (precision "medium", docs/precision.md): close, not equal.
    print(f"max |tpu - cpu| pixel difference: {np.abs(images - cpu).max():.2e}")


if __name__ == "__main__":
    main()
