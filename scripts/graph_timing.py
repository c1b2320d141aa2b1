"""Microseconds per call of a small kernel, from CUDA-graph replays (the probes' shared timing)."""

import torch

CALLS = 50


def us_per_call(call, calls: int = CALLS, replays: int = 20) -> float:
    """Warm call() up on a side stream, capture `calls` of it in one graph, and return the median
    over `replays` replays of the time per call, in microseconds."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]
