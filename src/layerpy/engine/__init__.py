"""The state engine (Kraken's idea): mutations declared as data, planned and enforced per node.

``Graph`` validates the declarations and finds the cheapest path from what was observed
(*dsc*) to what is wanted (*cfg*); ``Engine`` walks every node along its path, one
observed edge at a time, on one asyncio loop. No sockets, no drivers: those declare
their mutations here and receive the actions the engine fires.
"""

from layerpy.engine.executor import Engine
from layerpy.engine.graph import Graph, NoPath
from layerpy.engine.mutation import ANY, Mutation, Variable

__all__ = ["ANY", "Engine", "Graph", "Mutation", "NoPath", "Variable"]
