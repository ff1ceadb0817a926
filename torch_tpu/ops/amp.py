"""The two ops `torch.amp.GradScaler` runs on the gradients' device (CUDA's kernels' semantics).

Lowered as the functional ops; the in-place forms GradScaler calls are derived (registry.py), so
unscaling and the scale update stay on the device instead of falling back to the CPU every step.
"""
from __future__ import annotations

import jax.numpy as jnp

from torch_tpu.ops.registry import aten, lowers


@lowers(aten._amp_foreach_non_finite_check_and_unscale.default)
def amp_foreach_non_finite_check_and_unscale(tensors, found_inf, inv_scale):
    # Every tensor is multiplied by inv_scale (in float32, like CUDA's opmath); found_inf becomes 1
    # if any element of any tensor is inf or nan, else keeps its value.
    inv = inv_scale.reshape(()).astype(jnp.float32)
    bad = jnp.zeros((), dtype=jnp.bool_)
    out = []
    for t in tensors:
        bad = bad | ~jnp.all(jnp.isfinite(t))
        out.append((t.astype(jnp.float32) * inv).astype(t.dtype))
    return out, jnp.where(bad, jnp.ones_like(found_inf), found_inf)


@lowers(aten._amp_update_scale.default, static_scalars=True)
def amp_update_scale(scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    # Back off and restart the count after an inf/nan step; grow after growth_interval clean steps
    # (only to a finite scale).
    found = found_inf.reshape(scale.shape) > 0
    successful = growth_tracker + 1
    grow = successful == growth_interval
    grown = scale * scale_growth_factor
    grown = jnp.where(jnp.isfinite(grown), grown, scale)
    new_scale = jnp.where(found, scale * scale_backoff_factor, jnp.where(grow, grown, scale))
    new_tracker = jnp.where(found | grow, jnp.zeros_like(growth_tracker), successful)
    return new_scale.astype(scale.dtype), new_tracker.astype(growth_tracker.dtype)
