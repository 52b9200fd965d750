"""The node lifecycle: the mutation table (data), the actions it names, and the binding of
the state engine to the node store."""

from layerpy.lifecycle.actions import ACTIONS
from layerpy.lifecycle.binding import Lifecycle
from layerpy.lifecycle.fence import Fence, Fenced
from layerpy.lifecycle.table import VARIABLES, desired, markdown_table, mutations

__all__ = [
    "ACTIONS",
    "VARIABLES",
    "Fence",
    "Fenced",
    "Lifecycle",
    "desired",
    "markdown_table",
    "mutations",
]
