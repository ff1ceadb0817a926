"""Entry point of PyTorch's `torch.backends` group (device-backend autoload).

Separate from `torch_tpu/__init__.py` on purpose: `import torch_tpu` imports
torch, whose autoload imports this module while torch_tpu is still
initialising; importing the package here then returns the partial module and
torch_tpu finishes registering itself once torch is ready.
"""


def load() -> None:
    import torch_tpu  # noqa: F401  (registration happens on import)
