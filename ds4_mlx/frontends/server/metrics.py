"""Server counters in the Prometheus text exposition format (``GET /metrics``)."""

from __future__ import annotations

import threading
from collections import Counter


def _labels(**kv) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(kv.items())) + "}"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter = Counter()      # (endpoint, status)
        self.finishes: Counter = Counter()      # finish reason
        self.cache_hits: Counter = Counter()    # cache source
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.disconnects = 0
        # the bounded device expert cache (``--experts-cache``): decode hits/misses, bytes read
        # from the model file by phase
        self.expert_hits = 0
        self.expert_misses = 0
        self.expert_bytes: Counter = Counter()  # phase -> bytes
        self.drafted_tokens = 0   # speculative decoding
        self.accepted_tokens = 0

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def generation(self, *, finish: str, prompt: int, cached: int, completion: int, source: str,
                   prefill_s: float, decode_s: float, expert_hits: int = 0, expert_misses: int = 0,
                   expert_bytes: tuple[int, int] = (0, 0), drafted: int = 0, accepted: int = 0) -> None:
        with self._lock:
            self.expert_hits += expert_hits
            self.expert_misses += expert_misses
            self.expert_bytes["prefill"] += expert_bytes[0]
            self.expert_bytes["decode"] += expert_bytes[1]
            self.finishes[finish] += 1
            self.cache_hits[source] += 1
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            self.completion_tokens += completion
            self.prefill_seconds += prefill_s
            self.decode_seconds += decode_s
            self.drafted_tokens += drafted
            self.accepted_tokens += accepted

    def disconnect(self) -> None:
        with self._lock:
            self.disconnects += 1

    def render(self, *, queue_depth: int, busy: bool) -> str:
        with self._lock:
            lines = ["# HELP ds4_requests_total HTTP requests by endpoint and status.",
                     "# TYPE ds4_requests_total counter"]
            for (ep, st), n in sorted(self.requests.items()):
                lines.append(f"ds4_requests_total{_labels(endpoint=ep, status=st)} {n}")
            lines += ["# HELP ds4_generations_total Finished generations by finish reason.",
                      "# TYPE ds4_generations_total counter"]
            for fin, n in sorted(self.finishes.items()):
                lines.append(f"ds4_generations_total{_labels(finish=fin)} {n}")
            lines += ["# HELP ds4_cache_hits_total Generations by where their prompt prefix came from.",
                      "# TYPE ds4_cache_hits_total counter"]
            for src, n in sorted(self.cache_hits.items()):
                lines.append(f"ds4_cache_hits_total{_labels(source=src)} {n}")
            lines += ["# HELP ds4_expert_cache_bytes_read_total Routed-expert bytes read from the model file "
                      "by the bounded expert cache (--experts-cache), by phase.",
                      "# TYPE ds4_expert_cache_bytes_read_total counter"]
            for phase in ("decode", "prefill"):
                lines.append(f"ds4_expert_cache_bytes_read_total{_labels(phase=phase)} {self.expert_bytes[phase]}")
            pre_tps = ((self.prompt_tokens - self.cached_tokens) / self.prefill_seconds
                       if self.prefill_seconds > 0 else 0.0)
            dec_tps = self.completion_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0
            for name, kind, value, doc in (
                ("ds4_prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens."),
                ("ds4_cached_prompt_tokens_total", "counter", self.cached_tokens,
                 "Prompt tokens reused from a cache."),
                ("ds4_completion_tokens_total", "counter", self.completion_tokens, "Generated tokens."),
                ("ds4_prefill_tokens_per_second", "gauge", round(pre_tps, 3),
                 "Average prefill speed over all requests."),
                ("ds4_decode_tokens_per_second", "gauge", round(dec_tps, 3),
                 "Average decode speed over all requests."),
                ("ds4_expert_cache_hits_total", "counter", self.expert_hits,
                 "Decode accesses of a routed expert found in the bounded expert cache."),
                ("ds4_expert_cache_misses_total", "counter", self.expert_misses,
                 "Decode accesses of a routed expert read from the model file."),
                ("ds4_spec_drafted_total", "counter", self.drafted_tokens,
                 "Speculative decoding: draft tokens the model verified."),
                ("ds4_spec_accepted_total", "counter", self.accepted_tokens,
                 "Speculative decoding: draft tokens the model's own choice agreed with."),
                ("ds4_client_disconnects_total", "counter", self.disconnects,
                 "Requests cancelled because the client went away."),
                ("ds4_queue_depth", "gauge", queue_depth, "Requests waiting for the worker."),
                ("ds4_busy", "gauge", int(busy), "1 while the worker is generating."),
            ):
                lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"
