"""How long one collective takes on this rank: eager calls timed by perf_counter (cpu) or CUDA
events, or calls captured in a CUDA graph and replayed."""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
import torch.distributed as dist


class Timer:
    """Per-rank time of one collective, in microseconds."""

    def __init__(self, device: torch.device, iters: int, warmup: int, graph_replays: int,
                 capture: Callable[[], ContextManager[object]] = nullcontext):
        self.cuda = device.type == "cuda"
        self.iters = iters
        self.warmup = warmup
        self.graph_replays = graph_replays
        # Communicator.graph_capture where it exists: captured custom all-reduces then read
        # their inputs in place at replay, as a serving engine's graphs would, instead of
        # timing an extra staging copy per call.
        self.capture = capture

    def barrier(self) -> None:
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, call: Callable[[], object]) -> float:
        # Graph mode always runs one eager call first: a path that refuses the call then says
        # so outside capture, and lazy setup never happens inside it.
        for _ in range(max(self.warmup, 1 if self.cuda and self.graph_replays > 0 else 0)):
            call()
        if not self.cuda:
            self.barrier()
            start = time.perf_counter()
            for _ in range(self.iters):
                call()
            return (time.perf_counter() - start) * 1e6 / self.iters
        if self.graph_replays > 0:
            return self._graph(call)
        return self._eager_cuda(call)

    def _eager_cuda(self, call: Callable[[], object]) -> float:
        start, end = _events()
        self.barrier()
        start.record()
        for _ in range(self.iters):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / self.iters

    def _graph(self, call: Callable[[], object]) -> float:
        # n collectives captured back to back, replayed G times with no barrier in between:
        # a barrier per replay would add the ranks' start skew to every sample.
        graph = torch.cuda.CUDAGraph()
        with self.capture(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(self.iters):
                call()
        graph.replay()  # untimed: the first launch also uploads the graph to the device
        start, end = _events()
        self.barrier()
        start.record()
        for _ in range(self.graph_replays):
            graph.replay()
        end.record()
        end.synchronize()
        elapsed_ms = start.elapsed_time(end)
        del graph
        return elapsed_ms * 1e3 / (self.iters * self.graph_replays)


def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
