"""The hook engine: capture and override routing in every MoE layer, batched probes, the one forward loop."""

from .hooks import Engine, RoutingEvent, select_layers
from .probes import NODES, expert_nodes, expert_outputs, node_scores
from .runner import NLL, ForwardResult, forward

__all__ = ["Engine", "RoutingEvent", "select_layers", "NODES", "expert_nodes", "expert_outputs", "node_scores", "NLL",
           "ForwardResult", "forward"]
