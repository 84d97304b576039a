"""Your own code as a row of ``compare``: a function or a wrapper class, drawn from outside.

Teaches: nothing in a gradient synchronization has to cooperate to be measured
and drawn. ``as_strategy("mine", MyOverlapDDP)`` registers the learner's class
(or a function called after backward) as a strategy; ``compare`` then trains
it beside ddplab's and torch's, and draws it from what the rank's observing
process group was handed (``ddplab.timeline.on_group``), as it draws torch DDP.

Leaves out: options (the class is built as ``code(model, *args)``); code that
records itself (ddplab's full reducers) is refused: compare it by its registered
name, since it also makes all-reduces that are not buckets.
"""
from __future__ import annotations

import inspect

from ddplab.sync.registry import Strategy, get_strategy, register_strategy, strategy_names

_YOURS: set = set()  # names registered by as_strategy: running its cell again replaces them


def _parameters(code) -> tuple:
    try:
        return tuple(inspect.signature(code).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return ()


def as_strategy(name: str, code, *args, shape: str = "after_backward",
                description: str = "") -> Strategy:
    """Your own code as a strategy ``compare`` can run, registered as ``name``.

    ``code``: a function called after ``loss.backward()`` as ``code(model)``, or a
    wrapper class built as ``code(model, *args)``; its ``finish_gradient_synchronization()``,
    if it has one, is called after ``loss.backward()``. It takes no recorder: compare
    draws it from the observing process group, as it draws torch DDP. Calling it again
    with the same name replaces it; a built-in name is refused.
    """
    if name in strategy_names() and name not in _YOURS:
        raise ValueError(f"{name!r} is already a strategy; give your code another name")
    if callable(code) and "recorder" in _parameters(code):
        # it stamps its own buckets, and makes all-reduces that are not buckets (an
        # order check, a map of used parameters): drawn from the group they would count
        raise ValueError(f"{getattr(code, '__name__', code)!r} records itself: compare it by its "
                         "registered name (overlap, bucketed, manual), not through as_strategy")
    if isinstance(code, type):
        def build(module):
            wrapped = code(module, *args)
            return wrapped, getattr(wrapped, "finish_gradient_synchronization", None)
    elif callable(code):
        def build(module):
            return module, lambda: code(module)
    else:
        raise TypeError(f"as_strategy({name!r}, ...): give a function of the model or a wrapper "
                        f"class, not {type(code).__name__}")
    text = description or (inspect.getdoc(code) or "").split("\n")[0] or "your code"
    register_strategy(name, build, description=text, shape=shape, replace=True)
    _YOURS.add(name)
    return get_strategy(name)
