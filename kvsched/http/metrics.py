"""The front end's own Prometheus metrics (its own registry, served at /metrics): requests by
endpoint and HTTP status, finished requests by reason, latencies, tokens."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class HttpMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "kvsched_http_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "kvsched_http_finished",
            "Generations ended, by endpoint and finish reason (stop, length, abort, error, "
            "disconnect)",
            ["endpoint", "reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvsched_http_requests_in_flight", "Generations being served", registry=r
        )
        self.latency = Histogram(
            "kvsched_http_request_duration_seconds",
            "From the HTTP request's arrival to its last byte",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvsched_http_time_to_first_token_seconds",
            "From the HTTP request's arrival to its first output tokens",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvsched_http_prompt_tokens", "Prompt tokens of served requests", registry=r
        )
        self.resumes = Counter(
            "kvsched_http_resumes",
            "Broken kvsched streams taken up again through RequestService.Resume",
            registry=r,
        )
        self.completion_tokens = Counter(
            "kvsched_http_completion_tokens", "Output tokens sent back", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
