"""Prometheus metrics of one server (prometheus_client, in a registry of its own).

Names follow vLLM's where one exists (with the `dsv4:` prefix), so dashboards carry over. Gauges are set
by the engine driver's thread after every engine step (and while idle); counters and histograms are
observed by each request's output sink as outputs leave the engine, so they cost nothing on the HTTP
side. Time to first token and inter-token latency are observed for streamed requests (a non-streamed
request's tokens are only seen when it finishes).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "dsv4:"
# Bucket bounds in seconds: from one fast CPU decode step (~1 ms) to a long generation.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
E2E_BUCKETS = (0.01, 0.04, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92, 163.84)


class ServerMetrics:
    """Every metric the server exports; `render()` is the /metrics body."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        # Counted in sequences (completions: a request with n=4 counts 4), as the engine schedules them.
        self.requests_running = gauge("num_requests_running", "Sequences holding a cache slot.")
        self.requests_waiting = gauge(
            "num_requests_waiting",
            "Sequences queued: waiting for a cache slot, held while generation is paused, or retracted.",
        )
        self.cache_slots_used = gauge("cache_slots_used", "Per-sequence cache slots in use.")
        self.cache_slots_total = gauge("cache_slots_total", "Per-sequence cache slots (max_num_seqs).")
        self.weights_version = gauge("weights_version", "Version of the weights serving now (bumped per update).")
        self.paused = gauge("generation_paused", "1 while generation is paused by an admin or a weight update.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._finished = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token (streamed requests).", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between successive token deliveries (streamed requests).",
            ITL_BUCKETS,
        )
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        # Speculative decoding: fed by the driver from the engine's totals when a drafter runs (without one
        # they stay 0, and the per-position counter has no samples).
        self.spec_drafts = counter("spec_decode_num_drafts", "Verify chunks (a sequence's drafts of one step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position.",
            ["model_name", "position"], registry=self.registry,
        )
        self._spec_seen = None  # the engine totals already counted (`SpeculationMetrics`)

    def finished(self, reason: str) -> None:
        self._finished.labels(self._model_name, reason).inc()

    def observe_speculation(self, totals) -> None:
        """Count what the engine's speculation totals (`SpeculationMetrics`) gained since the last call."""
        seen = self._spec_seen
        if seen is not None and totals.verify_steps == seen.verify_steps:
            return
        if seen is not None and totals.verify_steps < seen.verify_steps:  # the engine's totals were reset
            seen = None
        before = (0, 0, 0, ()) if seen is None else (seen.verify_steps, seen.draft_tokens, seen.accepted_tokens,
                                                     seen.accepted_per_position)
        self.spec_drafts.inc(totals.verify_steps - before[0])
        self.spec_draft_tokens.inc(totals.draft_tokens - before[1])
        self.spec_accepted_tokens.inc(totals.accepted_tokens - before[2])
        for position, accepted in enumerate(totals.accepted_per_position):
            earlier = before[3][position] if position < len(before[3]) else 0
            self.spec_accepted_per_pos.labels(self._model_name, str(position)).inc(accepted - earlier)
        self._spec_seen = totals

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
