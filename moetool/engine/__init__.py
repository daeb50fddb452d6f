"""The hook engine: capture and override routing in every MoE layer, batched probes, streaming runs."""

from .hooks import Engine, RoutingEvent
from .probes import NODES, expert_nodes, expert_outputs, node_scores
from .runner import NLL, run_batches

__all__ = ["Engine", "RoutingEvent", "NODES", "expert_nodes", "expert_outputs", "node_scores", "NLL", "run_batches"]
