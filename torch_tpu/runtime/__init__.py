"""The runtime: PJRT platform and devices, storage buffers and their strided views, host<->device copies.

`platform`, `storage`, `local_device`, `dtypes` and `errors` import no JAX at module import
(`platform.init()` does, on first use); `strided` (pure JAX view reads/writes, used inside
every executor's programs) and `transfer` are first imported once the runtime is up.
Nothing here imports an executor (eager/, compile/, distributed/): tests/test_layering.py.
"""
