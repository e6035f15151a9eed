"""Small FX helpers shared by the passes: a node's value, node predicates, casts, argument access, rewriting."""
from __future__ import annotations

from typing import Optional

import torch

Node = torch.fx.Node

# Dtype (or device) casts as models write them in torch IR, and as they appear once traced to aten.
CAST_METHODS = {"float", "half", "bfloat16", "to", "type_as", "type"}
CAST_FUNCTIONS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}


# -------------------------------------------------------------------------------------------------------
# Values and arguments
# -------------------------------------------------------------------------------------------------------
def value_of(arg):
    """The value behind a graph argument: a node's fake tensor (or SymInt/SymFloat), a constant as is.
    Dynamo's nodes keep it in ``example_value``, AOTAutograd's in ``val``."""
    if isinstance(arg, Node):
        return arg.meta.get("example_value", arg.meta.get("val"))
    return arg


def arg_of(node: Node, index: int, name: str, default=None):
    """An argument passed either by position ``index`` or by keyword ``name``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def single_user(node: Node) -> Optional[Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


# -------------------------------------------------------------------------------------------------------
# Predicates
# -------------------------------------------------------------------------------------------------------
def is_call(node, functions, method: Optional[str] = None) -> bool:
    """A call_function of one of ``functions``, or a call_method named ``method``."""
    if not isinstance(node, Node):
        return False
    if node.op == "call_function" and node.target in functions:
        return True
    return method is not None and node.op == "call_method" and node.target == method


def is_cast(node, float_only: bool = False) -> bool:
    """x.float(), x.to(dtype), x.type_as(y), aten._to_copy, ...: a cast of its first argument.
    ``float_only``: only one from a floating dtype to another, same shape and device (a pass that computes the
    chain in fp32 itself may skip that rounding, but not a cast that changes what the values are)."""
    if not isinstance(node, Node) or not node.args:
        return False
    if not (node.op == "call_method" and node.target in CAST_METHODS
            or node.op == "call_function" and node.target in CAST_FUNCTIONS):
        return False
    if not float_only:
        return True
    val, src_val = value_of(node), value_of(node.args[0])
    if not isinstance(val, torch.Tensor) or not isinstance(src_val, torch.Tensor):
        return False
    return (val.shape == src_val.shape and val.device == src_val.device
            and val.is_floating_point() and src_val.is_floating_point())


def strip_casts(node, float_only: bool = False):
    """The tensor under any chain of casts (see ``is_cast``); ``node`` itself when it is no cast."""
    while is_cast(node, float_only):
        node = node.args[0]
    return node


# -------------------------------------------------------------------------------------------------------
# Rewriting
# -------------------------------------------------------------------------------------------------------
def replace_node(graph: torch.fx.Graph, old: Node, new: Node) -> None:
    """``new`` takes ``old``'s place: its metadata (fake value, source stack), its uses; ``old`` is erased."""
    new.meta.update(old.meta)
    old.replace_all_uses_with(new)
    graph.erase_node(old)


def finish_rewrite(gm: torch.fx.GraphModule, changed: bool, dead_code: bool = True) -> torch.fx.GraphModule:
    """After a pass rewrote ``gm``: drop the nodes nothing uses any more, check the graph, regenerate code."""
    if changed:
        if dead_code:
            gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return gm
