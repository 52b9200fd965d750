"""Observed node state: one store writes it, one feed tells everyone what changed."""

from layerpy.nodes.discovery import DISCOVERY, UnknownMachine
from layerpy.nodes.feed import GAP, Change, ChangeFeed, Subscription
from layerpy.nodes.store import Ack, NodeStore, ReportRejected

__all__ = [
    "DISCOVERY",
    "GAP",
    "Ack",
    "Change",
    "ChangeFeed",
    "NodeStore",
    "ReportRejected",
    "Subscription",
    "UnknownMachine",
]
