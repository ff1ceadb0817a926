"""`torch.tpu.optimizers`: TorchTPU's functional optimizers and its single-program trainer (docs/compat.md).

An optimizer here holds hyperparameters only; its state lives in a `ParamGroup` (a
pytree of dicts of tensors: parameters, moments, step counts) that `step(group, grads)`
maps to a new one without writing any tensor in place. So one step can be traced,
and `SingleTraceTrainer` traces forward, loss, backward and the optimizer step into
one ATen graph (`make_fx`) that the "tpu" compile backend runs as one XLA program.

Each update is the one of the torch.optim class of the same name (AdamW, SGD, Muon);
step counts are tensors, so a new step is the same program with other inputs. Lives
in `_internal` because Dynamo traces that package (torch_tpu/compile/__init__.py).
"""
from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, Callable

import torch
from torch.utils import _pytree

__all__ = ["Optimizer", "AdamW", "Sgd", "Muon", "SingleTraceTrainer", "ParamGroup"]


@dataclasses.dataclass
class ParamGroup:
    """Parameters and optimizer state by parameter name (unused states stay empty)."""

    params: dict[str, torch.Tensor]
    opt_state_m: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # first moment / momentum
    opt_state_v: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # second moment
    opt_steps: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # float32 steps taken
    extra_state: dict[str, Any] = dataclasses.field(default_factory=dict)

    def replace(self, **changes) -> "ParamGroup":
        return dataclasses.replace(self, **changes)


_FIELDS = ("params", "opt_state_m", "opt_state_v", "opt_steps", "extra_state")
_pytree.register_pytree_node(
    ParamGroup,
    lambda g: (tuple(getattr(g, f) for f in _FIELDS), None),
    lambda children, _: ParamGroup(*children),
    serialized_type_name="torch_tpu._internal.optimizers.ParamGroup",
)


def _named(params) -> dict[str, torch.Tensor]:
    if isinstance(params, torch.nn.Module):
        return {name: p.detach() for name, p in params.named_parameters()}
    if not isinstance(params, dict):
        raise TypeError(f"expected a dict of tensors or an nn.Module, got {type(params).__name__}")
    return {name: p.detach() for name, p in params.items()}


def _check(name: str, value: float, low: float = 0.0, high: float | None = None) -> None:
    if not isinstance(value, (int, float)) or value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"Invalid {name}: {value!r} (expected {bound})")


class Optimizer(abc.ABC):
    """A functional optimizer: `init_param_group(params)`, then `group = step(group, grads)` (or `opt(group, grads)`)."""

    ParamGroup = ParamGroup

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.0):
        _check("learning rate", lr)
        _check("weight_decay value", weight_decay)
        self.lr = lr
        self.weight_decay = weight_decay

    def init_param_group(self, params) -> ParamGroup:
        """A fresh ParamGroup for `params` (a dict of tensors or an nn.Module's named parameters)."""
        params = _named(params)
        return ParamGroup(params=params, opt_steps={n: torch.zeros((), dtype=torch.float32, device=p.device)
                                                    for n, p in params.items()}, **self._init_state(params))

    def _init_state(self, params: dict) -> dict:
        return {}

    def step(self, param_group: ParamGroup, grads: dict[str, torch.Tensor]) -> ParamGroup:
        """The group after one step with `grads` (by parameter name; a missing or None grad leaves it as is)."""
        new = {field: dict(getattr(param_group, field)) for field in _FIELDS[:4]}
        for name, param in param_group.params.items():
            grad = grads.get(name)
            if grad is None:
                continue
            state = {f: param_group.__dict__[f].get(name) for f in ("opt_state_m", "opt_state_v")}
            step = param_group.opt_steps[name] + 1
            param, state = self._update(name, param, grad, state, step)
            new["params"][name] = param
            new["opt_steps"][name] = step
            for field, value in state.items():
                if value is not None:
                    new[field][name] = value
        return ParamGroup(**new, extra_state=dict(param_group.extra_state))

    @abc.abstractmethod
    def _update(self, name: str, param, grad, state: dict, step):
        """(new param, new state) for one parameter; `step` counts this step (1 on the first)."""

    def __call__(self, param_group: ParamGroup, grads: dict[str, torch.Tensor]) -> ParamGroup:
        return self.step(param_group, grads)


class AdamW(Optimizer):
    """torch.optim.AdamW's update; moments in bfloat16 with `use_bfloat16_moments` (computed in float32)."""

    def __init__(self, lr: float = 1e-3, weight_decay: float = 1e-2, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, use_bfloat16_moments: bool = True):
        super().__init__(lr=lr, weight_decay=weight_decay)
        _check("beta1", beta1, 0.0, 1.0)
        _check("beta2", beta2, 0.0, 1.0)
        _check("epsilon value", eps)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.use_bfloat16_moments = use_bfloat16_moments

    def _init_state(self, params):
        dtype = torch.bfloat16 if self.use_bfloat16_moments else None
        return {"opt_state_m": {n: torch.zeros_like(p, dtype=dtype) for n, p in params.items()},
                "opt_state_v": {n: torch.zeros_like(p, dtype=dtype) for n, p in params.items()}}

    def _update(self, name, param, grad, state, step):
        m, v = state["opt_state_m"], state["opt_state_v"]
        work = torch.promote_types(param.dtype, torch.float32) if m.dtype != param.dtype else param.dtype
        g = grad.to(work)
        m_new = m.to(work) * self.beta1 + g * (1 - self.beta1)
        v_new = v.to(work) * self.beta2 + g * g * (1 - self.beta2)
        bias1 = 1 - torch.pow(self.beta1, step)
        bias2_sqrt = torch.sqrt(1 - torch.pow(self.beta2, step))
        denom = v_new.sqrt() / bias2_sqrt + self.eps
        p = param.to(work) * (1 - self.lr * self.weight_decay)
        p = p - (self.lr / bias1) * m_new / denom
        return p.to(param.dtype), {"opt_state_m": m_new.to(m.dtype), "opt_state_v": v_new.to(v.dtype)}


class Sgd(Optimizer):
    """torch.optim.SGD's update (momentum, dampening, weight decay, Nesterov)."""

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False):
        super().__init__(lr=lr, weight_decay=weight_decay)
        _check("momentum value", momentum)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.momentum, self.dampening, self.nesterov = momentum, dampening, nesterov

    def _init_state(self, params):
        if not self.momentum:
            return {}
        return {"opt_state_m": {n: torch.zeros_like(p) for n, p in params.items()}}

    def _update(self, name, param, grad, state, step):
        d_p = grad + self.weight_decay * param if self.weight_decay else grad
        if not self.momentum:
            return param - self.lr * d_p, {}
        buf = state["opt_state_m"]
        # torch.optim.SGD starts the buffer at the first gradient (no dampening on step 1).
        buf = torch.where(step == 1, d_p, buf * self.momentum + (1 - self.dampening) * d_p)
        d_p = d_p + self.momentum * buf if self.nesterov else buf
        return param - self.lr * d_p, {"opt_state_m": buf}


class Muon(Optimizer):
    """torch.optim.Muon's update (2-D parameters): momentum, then Newton-Schulz orthogonalization."""

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple = None, eps: float = None, ns_steps: int = None,
                 adjust_lr_fn: str | None = None):
        from torch.optim import _muon

        super().__init__(lr=lr, weight_decay=weight_decay)
        _check("momentum value", momentum)
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        self.momentum, self.nesterov, self.adjust_lr_fn = momentum, nesterov, adjust_lr_fn
        self.ns_coefficients = ns_coefficients or (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
        self.eps = _muon.EPS if eps is None else eps
        self.ns_steps = _muon.DEFAULT_NS_STEPS if ns_steps is None else ns_steps

    def _init_state(self, params):
        for name, p in params.items():
            if p.dim() != 2:
                raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter {name!r} with size "
                                 f"{list(p.shape)}")
        return {"opt_state_m": {n: torch.zeros_like(p) for n, p in params.items()}}

    def _update(self, name, param, grad, state, step):
        from torch.optim import _muon

        buf = state["opt_state_m"].lerp(grad, 1 - self.momentum)
        update = grad.lerp(buf, self.momentum) if self.nesterov else buf
        update = _muon._zeropower_via_newtonschulz(update, self.ns_coefficients, self.ns_steps, self.eps)
        lr = _muon._adjust_lr(self.lr, self.adjust_lr_fn, param.shape)
        p = param * (1 - self.lr * self.weight_decay) - lr * update.to(param.dtype)
        return p, {"opt_state_m": buf}


# ------------------------------------------------------------------ the trainer
def _loss_of(out, targets):
    if targets is not None:
        return torch.nn.functional.mse_loss(out, targets)
    for get in (lambda o: getattr(o, "loss", None), lambda o: o.get("loss") if isinstance(o, dict) else None):
        loss = get(out)
        if isinstance(loss, torch.Tensor):
            return loss
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out.reshape(())
    raise TypeError(f"SingleTraceTrainer: cannot find a loss in the model's output ({type(out).__name__}); "
                    "pass targets (MSE) or return a scalar tensor or an object with .loss")


def _default_compile(graph_module, example_inputs):
    from torch_tpu._internal.compile._backend import TpuBackend

    return TpuBackend()(graph_module, list(example_inputs))


class SingleTraceTrainer:
    """Train steps compiled as one program: forward, loss, backward and the optimizer step.

    `step = trainer.make_compiled_train_step(example_inputs, example_targets)`, then
    `loss = step(inputs, targets)` per batch. The loss is MSE against `targets` if given,
    else the model's `.loss` / `["loss"]` or its scalar output. The model's parameters and
    buffers are kept current (`.data` replaced after each step); `trainer.params`,
    `trainer.bufs` and `trainer.param_group` hold the state. `compile_fn(graph_module,
    example_inputs) -> callable` defaults to the "tpu" compile backend.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Optimizer, compile_fn: Callable | None = None):
        self.model = model
        self.optimizer = optimizer
        self.compile_fn = compile_fn
        self.param_group = optimizer.init_param_group(model)
        self.buffers = {name: b.detach() for name, b in model.named_buffers()}

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.param_group.params)

    @property
    def bufs(self) -> dict[str, torch.Tensor]:
        return dict(self.buffers)

    def _loss(self, params, buffers, inputs, targets):
        args, kwargs = ((), inputs) if isinstance(inputs, dict) else \
            (tuple(inputs), {}) if isinstance(inputs, (tuple, list)) else ((inputs,), {})
        out = torch.func.functional_call(self.model, (params, buffers), args, kwargs)
        return _loss_of(out, targets), buffers

    def make_compiled_train_step(self, example_inputs, example_targets=None, compile_fn: Callable | None = None):
        from torch.fx.experimental.proxy_tensor import make_fx

        compile_fn = compile_fn or self.compile_fn or _default_compile
        has_targets = example_targets is not None
        state = (self.param_group, self.buffers)
        flat, in_spec = _pytree.tree_flatten((state, example_inputs, example_targets))

        def flat_step(*flat_args):
            (group, buffers), inputs, targets = _pytree.tree_unflatten(list(flat_args), in_spec)
            loss_fn = functools.partial(self._loss, inputs=inputs, targets=targets)
            grads, (loss, new_buffers) = torch.func.grad_and_value(loss_fn, has_aux=True)(group.params, buffers)
            new_group = self.optimizer(group, grads)
            return tuple(_pytree.tree_leaves((loss.detach(), new_group, new_buffers)))

        graph = make_fx(flat_step, tracing_mode="fake")(*flat)
        compiled = compile_fn(graph, flat)
        out_spec = _pytree.tree_structure((torch.zeros(()), self.param_group, self.buffers))

        def train_step(inputs, targets=None):
            if (targets is not None) != has_targets:
                raise ValueError("train_step: pass targets exactly when example_targets were given")
            leaves, spec = _pytree.tree_flatten(((self.param_group, self.buffers), inputs, targets))
            if spec != in_spec:
                raise ValueError("train_step: inputs differ in structure from the example inputs")
            loss, group, buffers = _pytree.tree_unflatten(list(compiled(*leaves)), out_spec)
            self._install(group, buffers)
            return loss

        return train_step

    def _install(self, group: ParamGroup, buffers: dict) -> None:
        self.param_group, self.buffers = group, buffers
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.data = group.params[name]
            for name, b in self.model.named_buffers():
                if name in buffers:
                    b.data = buffers[name]
