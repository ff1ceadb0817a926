"""The layout of an op signature (the program cache key; eager/program.py describes it).

Entry tags, the tensor entries of an argument, and turning a key's entries back into
call arguments: shared by the program builder, the CPU-error replay (cpu_errors.py) and
the recompile explainer, none of which need each other for it.
"""
from __future__ import annotations

from torch_tpu.eager.opspec import Arg, OpSpec

TENSOR, CPU_SCALAR, SCALAR, SCALAR_LIST = "T", "C", "S", "L"
DYNAMIC = -1  # the offset field of a tensor entry whose storage offset is a runtime scalar

TENSOR_KINDS = (Arg.TENSOR, Arg.OPT_TENSOR)
LIST_KINDS = (Arg.TENSOR_LIST, Arg.OPT_TENSOR_LIST)


def tensor_entries(kind, entry) -> list:
    """The "T" entries inside one argument entry."""
    if entry is None:
        return []
    if kind in TENSOR_KINDS:
        return [entry] if entry[0] == TENSOR else []
    if kind in LIST_KINDS:  # a list may hold 0-dim CPU tensors (runtime scalars) among its tensors
        return [e for e in entry if e is not None and e[0] == TENSOR]
    return []


def rebuild(spec: OpSpec, key_args, scalars, make_tensor, make_scalar, make_cpu, make_list):
    """Turn key entries back into call arguments with the given constructors.

    Runtime scalars are consumed in argument order, a tensor's dynamic storage
    offset included. Returns (arguments, {(argument index, list index): offset}).
    """
    out = []
    offsets = {}
    position = 0

    def tensor(i, j, entry):
        nonlocal position
        offset = 0
        if entry[4] == DYNAMIC:
            offset = scalars[position]
            position += 1
        offsets[(i, j)] = offset
        return make_tensor(entry, offset)

    def element(i, j, entry):  # of a tensor list: a tensor, or a 0-dim CPU tensor (a runtime scalar)
        nonlocal position
        if entry[0] == CPU_SCALAR:
            position += 1
            return make_cpu(scalars[position - 1], entry[1])
        return tensor(i, j, entry)

    for i, (kind, entry) in enumerate(zip(spec.kinds, key_args)):
        if entry is None or kind == Arg.GENERATOR:
            out.append(None)
        elif kind in TENSOR_KINDS:
            if entry[0] == CPU_SCALAR:
                out.append(make_cpu(scalars[position], entry[1]))
                position += 1
            elif entry[0] == SCALAR:  # a wrapped Python number
                out.append(make_scalar(scalars[position], entry[1]))
                position += 1
            else:
                out.append(tensor(i, 0, entry))
        elif kind in LIST_KINDS:
            out.append([None if e is None else element(i, j, e) for j, e in enumerate(entry)])
        elif kind in (Arg.SCALAR, Arg.OPT_SCALAR) and type(entry) is tuple and entry[0] == SCALAR:
            out.append(make_scalar(scalars[position], entry[1]))
            position += 1
        elif kind == Arg.SCALAR_LIST and type(entry) is tuple and entry and entry[0] == SCALAR_LIST:
            n = len(entry[1])
            out.append(make_list(scalars[position:position + n], entry[1]))
            position += n
        elif kind in (Arg.SCALAR, Arg.OPT_SCALAR) and type(entry) is tuple:  # static scalar ("V", value)
            out.append(entry[1])
        else:
            out.append(entry)
    return out, offsets
