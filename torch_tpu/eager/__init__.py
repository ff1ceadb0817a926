"""Eager execution: turning each dispatched ATen op into a cached XLA program.

`opspec` reads op schemas, `strided` reads/writes strided views of flat storage
buffers inside programs, `program` builds one cached program per op signature,
`executor` runs them (Strict, Debug), `kernels` registers it all with PyTorch.
"""
