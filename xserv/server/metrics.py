"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand: a few counters and
histograms kept by the event loop, plus gauges read from the engine's latest stats() snapshot."""
from __future__ import annotations

import bisect
import math

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets=_LATENCY_BUCKETS):
        self.name = name
        self.help = help_text
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {self.sum!r}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests = {reason: 0 for reason in FINISH_REASONS}
        self.rejected = 0  # 503 for overload / draining
        self.ttft = Histogram("xserv_time_to_first_token_seconds", "Time from request arrival to its first token.")
        self.tpot = Histogram("xserv_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per finished choice.")
        self.e2e = Histogram("xserv_e2e_request_latency_seconds", "Time from request arrival to its last token.")

    def finished(self, reason: str, num_prompt_tokens: int, num_tokens: int, first_token_s: float | None,
                 total_s: float) -> None:
        """A choice ended (`reason` one of FINISH_REASONS); times in seconds since the request arrived."""
        self.requests[reason if reason in self.requests else "error"] += 1
        self.prompt_tokens += num_prompt_tokens
        self.generation_tokens += num_tokens
        self.e2e.observe(total_s)
        if first_token_s is not None:
            if num_tokens > 1:
                self.tpot.observe((total_s - first_token_s) / (num_tokens - 1))

    def render(self, stats: dict) -> str:
        lines = []

        def metric(name, kind, help_text, value, labels=""):
            lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{labels} {value}"))

        total, free = stats.get("kv_blocks_total", 0), stats.get("kv_blocks_free", 0)
        metric("xserv_num_requests_running", "gauge", "Sequences in the running batch.", stats.get("num_running", 0))
        metric("xserv_num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", stats.get("num_waiting", 0))
        metric("xserv_kv_blocks_total", "gauge", "KV cache blocks in the pool.", total)
        metric("xserv_kv_blocks_free", "gauge", "KV cache blocks free to allocate.", free)
        metric("xserv_kv_blocks_used", "gauge", "KV cache blocks in use.", total - free)
        metric("xserv_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
               stats.get("prefix_cache_query_tokens", 0))
        metric("xserv_prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache.",
               stats.get("prefix_cache_hit_tokens", 0))
        metric("xserv_num_preemptions_total", "counter", "Sequences preempted (KV blocks freed, recomputed later).",
               stats.get("num_preemptions", 0))
        metric("xserv_prompt_tokens_total", "counter", "Prompt tokens of finished choices.", self.prompt_tokens)
        metric("xserv_generation_tokens_total", "counter", "Output tokens of finished choices.",
               self.generation_tokens)
        metric("xserv_requests_rejected_total", "counter", "Requests refused with 503 (overloaded or draining).",
               self.rejected)
        name = "xserv_request_success_total"
        lines += [f"# HELP {name} Finished choices by finish reason.", f"# TYPE {name} counter"]
        lines += [f'{name}{{finish_reason="{r}"}} {n}' for r, n in self.requests.items()]
        for h in (self.ttft, self.tpot, self.e2e):
            lines += h.render()
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """{"name{labels}": value} of a Prometheus text page (for tests and `xserv bench serve`)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values
