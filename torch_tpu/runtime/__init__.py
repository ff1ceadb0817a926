"""The runtime: PJRT platform and devices, storage buffers, host<->device copies.

Nothing here imports JAX at module import; `platform.init()` does, on first use.
"""
