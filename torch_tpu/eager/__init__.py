"""Eager execution: turning each dispatched ATen op into a cached XLA program.

`opspec` reads op schemas, `program` builds one cached program per op signature
(its view reads and write-backs through runtime/strided.py), `executor` runs them
(Strict, Debug), `defer` records and fuses them (DeferAndFuse), `kernels` registers
it all with PyTorch.
"""
