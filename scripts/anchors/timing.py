"""Timing for the anchor scripts, the method of the Rust benches (src/lib.rs, `BenchGpu`).

- `graph_us`: a launch captured `n` times into a CUDA graph (rotating over buffer sets of at
  least COLD_BYTES together, so each launch finds its data out of the 50 MB L2: "cold"), the
  graph replayed 3 times untimed and 31 times timed with CUDA events, each replay's time
  divided by its launch count: the median, 10th and 90th percentile per launch (as
  `BenchGpu::capture` and `Timed::per_launch_us`).
- `calls_us`: events around each of 12 calls, the first dropped: median, p10, p90 of the other
  11 (as `BenchGpu::calls_us`, for work a graph cannot hold, e.g. a layer's 2.5 GB of experts).
"""

import torch

COLD_BYTES = 256 << 20


def cold_sets(bytes_per_call):
    """Buffer sets to rotate through so one pass touches at least COLD_BYTES (1 to 256)."""
    return max(1, min(256, -(-COLD_BYTES // max(1, bytes_per_call))))


def _quantiles(times):
    times = sorted(times)
    n = len(times)
    return times[n // 2], times[n // 10], times[n - 1 - n // 10]


def _event_ms(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def graph_us(launch, sets):
    """(median, p10, p90) microseconds per launch of `launch(set)`, replayed from a graph of
    `sets * ceil(64 / sets)` launches rotating over the sets."""
    n = sets * -(-64 // sets)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(sets, 3)):  # warm-up outside the capture (autotuning, workspaces)
            launch(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            launch(i % sets)
    for _ in range(3):
        graph.replay()
    return _quantiles([_event_ms(graph.replay) * 1e3 / n for _ in range(31)])


def calls_us(call):
    """(median, p10, p90) microseconds of `call()`, events around each of 12 calls, the first
    dropped."""
    return _quantiles([_event_ms(call) * 1e3 for _ in range(12)][1:])


def gpu_line():
    """The device and torch, as the first line of an anchor's output."""
    p = torch.cuda.get_device_properties(0)
    return f"GPU {p.name} (sm_{p.major}{p.minor}); torch {torch.__version__}, CUDA {torch.version.cuda}"
