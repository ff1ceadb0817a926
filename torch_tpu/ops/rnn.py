"""Recurrent cells: the fused LSTM and GRU cell kernels nn.LSTM / nn.GRU use off the CPU.

`aten.lstm`/`aten.gru` are CompositeImplicitAutograd: on any device but the
CPU (and without cuDNN/MIOpen) each time step is two `linear`s (addmm/mm,
lowered in ops/linalg.py at the float32 matmul precision) and one fused cell,
`_thnn_fused_lstm_cell` / `_thnn_fused_gru_cell`, whose backward kernels are
lowered here too. nn.RNN's tanh/relu cells are plain elementwise ops.

The workspace a cell saves for its backward follows CUDA's layout: the
activated LSTM gates (i, f, g, o); the GRU's (r, z, n, hx, hidden n-gate).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from torch_tpu.ops.registry import aten, lowers


def _opmath(x):
    return x.astype(jnp.float32) if x is not None and x.dtype in (jnp.bfloat16, jnp.float16) else x


def _biased(gates, bias):
    gates = _opmath(gates)
    return gates if bias is None else gates + _opmath(bias)


@lowers(aten._thnn_fused_lstm_cell.default)
def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = _biased(input_gates, input_bias) + _biased(hidden_gates, hidden_bias)
    i, f, g, o = jnp.split(gates, 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * _opmath(cx) + i * g
    hy = o * jnp.tanh(cy)
    # Cast back here: with no biases PyTorch's meta kernel fails and the dtypes come from this function.
    dtype = input_gates.dtype
    return hy.astype(dtype), cy.astype(dtype), jnp.concatenate([i, f, g, o], axis=-1).astype(dtype)


@lowers(aten._thnn_fused_lstm_cell_backward_impl.default)
def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = jnp.split(_opmath(workspace), 4, axis=-1)
    cx, cy = _opmath(cx), _opmath(cy)
    gh = jnp.zeros_like(cy) if grad_hy is None else _opmath(grad_hy)
    tanh_cy = jnp.tanh(cy)
    gc = gh * o * (1 - tanh_cy * tanh_cy) + (0 if grad_cy is None else _opmath(grad_cy))
    grad_gates = jnp.concatenate([
        gc * g * i * (1 - i),
        gc * cx * f * (1 - f),
        gc * i * (1 - g * g),
        gh * tanh_cy * o * (1 - o),
    ], axis=-1)
    grad_bias = jnp.sum(grad_gates, axis=0) if has_bias and grad_gates.ndim > 1 else grad_gates if has_bias else None
    return grad_gates, gc * f, grad_bias


@lowers(aten._thnn_fused_gru_cell.default)
def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    ir, iz, in_ = jnp.split(_biased(input_gates, input_bias), 3, axis=-1)
    hr, hz, hn = jnp.split(_biased(hidden_gates, hidden_bias), 3, axis=-1)
    r = jax.nn.sigmoid(ir + hr)
    z = jax.nn.sigmoid(iz + hz)
    n = jnp.tanh(in_ + r * hn)
    hx = _opmath(hx)
    hy = n + z * (hx - n)
    return hy.astype(hidden_gates.dtype), jnp.concatenate([r, z, n, hx, hn], axis=-1).astype(hidden_gates.dtype)


@lowers(aten._thnn_fused_gru_cell_backward.default)
def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, hn = jnp.split(_opmath(workspace), 5, axis=-1)
    g = _opmath(grad_hy)
    grad_n = g * (1 - z) * (1 - n * n)  # through the tanh
    grad_z = g * (hx - n) * z * (1 - z)
    grad_r = grad_n * hn * r * (1 - r)
    grad_input_gates = jnp.concatenate([grad_r, grad_z, grad_n], axis=-1)
    grad_hidden_gates = jnp.concatenate([grad_r, grad_z, grad_n * r], axis=-1)
    dtype = grad_hy.dtype
    if has_bias:
        biases = (jnp.sum(grad_input_gates, axis=0), jnp.sum(grad_hidden_gates, axis=0))
    else:  # PyTorch returns undefined tensors; nothing reads these
        biases = (jnp.zeros((0,), dtype), jnp.zeros((0,), dtype))
    return (grad_input_gates.astype(dtype), grad_hidden_gates.astype(dtype), (g * z).astype(dtype),
            *(b.astype(dtype) for b in biases))
