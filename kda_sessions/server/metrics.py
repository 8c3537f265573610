"""Prometheus text exposition (format 0.0.4), written by hand: engine counters plus HTTP requests by status."""

from __future__ import annotations

from collections import Counter
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, type, help, key in Engine.stats())
_ENGINE_METRICS = [
    ("kda_tokens_prefilled_total", "counter", "Prompt tokens run through the model.", "tokens_prefilled"),
    ("kda_tokens_decoded_total", "counter", "Tokens generated.", "tokens_decoded"),
    ("kda_prefill_avoided_tokens_total", "counter",
     "Context tokens reused from session state or a stored prefix instead of being prefilled.", "cached_tokens"),
    ("kda_cache_hit_ratio", "gauge", "cached / (cached + prefilled) context tokens since start.", "cache_hit_rate"),
    ("kda_prefix_cache_lookups_total", "counter",
     "New sessions (and resent histories) looked up in the tenant's prefix index.", "prefix_cache_lookups"),
    ("kda_prefix_cache_hits_total", "counter", "Lookups that started from a checkpointed prefix.", "prefix_cache_hits"),
    ("kda_prefix_cache_hit_tokens_total", "counter",
     "Tokens whose state came from a checkpointed prefix of another (or an earlier) session.", "prefix_cache_hit_tokens"),
    ("kda_segment_cache_hits_total", "counter",
     "Long pieces of resent text whose token ids came from the tokenizer's cache.", "segment_cache_hits"),
    ("kda_segment_cache_tokens", "gauge", "Token ids the tokenizer's cache of long pieces holds.", "segment_cache_tokens"),
    ("kda_message_cache_hits_total", "counter",
     "Messages of resent histories whose token ids came from the tokenizer's cache.", "message_cache_hits"),
    ("kda_message_cache_tokens", "gauge",
     "Token ids the tokenizer's cache of whole messages holds.", "message_cache_tokens"),
    ("kda_queue_depth", "gauge", "Requests waiting for or in prefill.", "queue_depth"),
    ("kda_sessions_in_memory", "gauge", "Sessions this engine holds.", "sessions_in_memory"),
    ("kda_sessions_active", "gauge", "Sessions whose state is in the pools.", "sessions_active"),
    ("kda_state_slots_free", "gauge", "Free KDA state slots.", "slots_free"),
    ("kda_kv_pages_free", "gauge", "Free MLA KV pages.", "pages_free"),
    ("kda_kv_pages_total", "gauge", "MLA KV pages in the pool.", "pages_total"),
    ("kda_engine_steps_total", "counter", "Engine steps run.", "steps"),
    ("kda_resumes_total", "counter", "Sessions loaded from the store.", "resumes"),
    ("kda_forks_total", "counter", "Sessions forked.", "forks"),
    ("kda_saves_total", "counter", "Session snapshots saved.", "saves"),
    ("kda_evictions_total", "counter", "Idle sessions saved to the store to free their slot and pages.", "evictions"),
    ("kda_preemptions_total", "counter",
     "Running generations parked (KV rows to host memory) to make room for others.", "preemptions"),
]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _route_label(path: str) -> str:
    """Bounded label values: session ids are collapsed so the series count stays small."""
    parts = path.split("/")
    if len(parts) > 3 and parts[1:3] == ["v1", "sessions"]:
        parts[3] = "{id}"
    label = "/".join(parts)
    return label if label in _KNOWN_ROUTES or label.startswith("/v1/sessions/{id}") else "other"


_KNOWN_ROUTES = {"/v1/chat/completions", "/v1/models", "/v1/sessions", "/v1/stats", "/health", "/metrics"}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.latency_counts = [0] * len(_LATENCY_BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0
        self.tool_choice_unmet = 0

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        self.requests[(_route_label(path), status)] += 1
        self.latency_sum += seconds
        self.latency_count += 1
        for i, le in enumerate(_LATENCY_BUCKETS):
            if seconds <= le:
                self.latency_counts[i] += 1

    def render(self, stats: dict[str, Any], resume_seconds: list[float]) -> str:
        lines: list[str] = []

        def head(name: str, kind: str, help_: str) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")

        for name, kind, help_, key in _ENGINE_METRICS:
            value = stats.get(key)
            if value is None:
                continue
            head(name, kind, help_)
            lines.append(f"{name} {_number(value)}")

        head("kda_resume_seconds", "summary", "Time to load a session from the store into the pools.")
        lines.append(f"kda_resume_seconds_sum {_number(float(sum(resume_seconds)))}")
        lines.append(f"kda_resume_seconds_count {len(resume_seconds)}")
        head("kda_resume_seconds_last", "gauge", "Duration of the latest resume (NaN before the first).")
        lines.append(f"kda_resume_seconds_last {_number(float(resume_seconds[-1])) if resume_seconds else 'NaN'}")

        head("kda_http_requests_total", "counter", "HTTP requests answered, by route and status.")
        for (route, status), n in sorted(self.requests.items()):
            lines.append(f'kda_http_requests_total{{route="{_escape(route)}",status="{status}"}} {n}')

        head("kda_http_request_duration_seconds", "histogram", "HTTP request duration (streams: until the end).")
        for le, n in zip(_LATENCY_BUCKETS, self.latency_counts):
            lines.append(f'kda_http_request_duration_seconds_bucket{{le="{le}"}} {n}')
        lines.append(f'kda_http_request_duration_seconds_bucket{{le="+Inf"}} {self.latency_count}')
        lines.append(f"kda_http_request_duration_seconds_sum {_number(self.latency_sum)}")
        lines.append(f"kda_http_request_duration_seconds_count {self.latency_count}")

        head("kda_tool_choice_unmet_total", "counter",
             "Replies to tool_choice required/named that carried no valid call (decoding is not constrained yet).")
        lines.append(f"kda_tool_choice_unmet_total {self.tool_choice_unmet}")
        return "\n".join(lines) + "\n"
