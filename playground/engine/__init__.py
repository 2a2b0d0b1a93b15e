"""The engine: a scheduler that never touches tensors, a runner that never touches queues, and a step that reads
schedule -> propose -> verify -> accept -> commit."""

from .engine import Engine, ProposalCounts, RequestOutput, one_request_costs
from .generate import generate, stream_generate, warm_up
from .scheduler import Request, Scheduler, Status, StepPlan

__all__ = ["Engine", "ProposalCounts", "Request", "RequestOutput", "Scheduler", "Status", "StepPlan", "generate",
           "one_request_costs", "stream_generate", "warm_up"]
