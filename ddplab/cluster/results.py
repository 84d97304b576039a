"""A rank's result on its way to the kernel: every tensor in it moved to the CPU.

Teaches: the learner's kernel must never touch CUDA. A CUDA tensor unpickled
in the kernel creates a CUDA context there: the kernel then holds memory on
that GPU, and the next Cluster (this learner's or another's) sees the GPU as
taken. So before a result leaves a rank, every tensor in it is copied to the
CPU, wherever it sits: in lists, tuples, dicts, and the containers torch
itself returns: ``model.state_dict()`` (an ``OrderedDict``),
``torch.max(t, dim=0)`` (a ``torch.return_types`` struct sequence), named
tuples, and dataclasses.

Leaves out: tensors inside arbitrary objects (attributes of a class of the
learner's own); those go as they are, and the kernel gets CUDA tensors.

References: torch.Tensor.cpu; collections.namedtuple (``_fields``,
``_make``); PyStructSequence (``n_fields``); dataclasses.replace.
"""
from __future__ import annotations

import dataclasses


def to_cpu(obj):
    """``obj`` with every tensor it holds detached and on the CPU (containers rebuilt)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        items = {k: to_cpu(v) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:  # OrderedDict (state_dict) and other dict subclasses keep their type
            out = type(obj)(items)
        except TypeError:
            return items
        if hasattr(obj, "__dict__"):  # e.g. a state_dict's _metadata
            out.__dict__.update(obj.__dict__)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)._make(to_cpu(x) for x in obj)
    if isinstance(obj, tuple) and hasattr(type(obj), "n_fields"):  # torch.return_types
        return type(obj)([to_cpu(x) for x in obj])
    if type(obj) in (list, tuple):
        return type(obj)(to_cpu(x) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        try:
            return dataclasses.replace(obj, **{f.name: to_cpu(getattr(obj, f.name))
                                               for f in dataclasses.fields(obj) if f.init})
        except (TypeError, ValueError):
            return obj
    return obj
