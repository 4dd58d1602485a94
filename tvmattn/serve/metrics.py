"""Prometheus metrics of a serving engine (prometheus-client, a registry of its own): running and
waiting requests, KV pages used and free, the bytes they hold against full attention (the
saving of sliding-window layers), the pages the prefix cache holds (when no request
runs, pages used minus those is a leak), prefix-cache hit rate, preemptions and the tokens they
made the engine prefill again, time-to-first-token and inter-token histograms, generated tokens
and output tokens/s over the last seconds, and which sampler chose the tokens (the library's
kernels, or the host: every choice with --sampling host, else the fallback rows).

`render()` counts the prefix cache's pages between two engine steps: call it from a worker
thread, not the server's event loop."""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)
RATE_WINDOW_S = 10.0


class EngineMetrics:
    """Hooks itself into the engine's timing callbacks; `render()` is the /metrics body."""

    def __init__(self, engine):
        self.engine = engine
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("tvmattn_requests_running", "Requests with a KV-cache sequence", registry=r)
        self.waiting = Gauge("tvmattn_requests_waiting", "Requests queued for admission", registry=r)
        self.pages_used = Gauge("tvmattn_kv_pages_used", "KV-cache pages in use", registry=r)
        self.pages_free = Gauge("tvmattn_kv_pages_free", "KV-cache pages free", registry=r)
        self.bytes_held = Gauge("tvmattn_kv_bytes_held", "KV-cache bytes the pages in use hold, every layer "
                                "(sliding-window layers: their windows only)", registry=r)
        self.bytes_full = Gauge("tvmattn_kv_bytes_full_attention", "KV-cache bytes the same tokens would hold "
                                "with every layer keeping every token", registry=r)
        self.hit_rate = Gauge("tvmattn_prefix_cache_hit_rate",
                              "Prompt tokens found in the prefix cache / prompt tokens looked up", registry=r)
        self.hit_tokens = Gauge("tvmattn_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache so far",
                                registry=r)
        self.queried_tokens = Gauge("tvmattn_prefix_cache_queried_tokens", "Prompt tokens looked up so far",
                                    registry=r)
        self.pages_prefix = Gauge("tvmattn_kv_pages_prefix_cache", "KV-cache pages the prefix cache's sequences hold",
                                  registry=r)
        self.preemptions = Gauge("tvmattn_preemptions", "Requests preempted (recomputed later) so far", registry=r)
        self.recomputed = Gauge("tvmattn_recomputed_tokens",
                                "Tokens of preempted requests prefilled again when readmitted, so far", registry=r)
        self.ttft = Histogram("tvmattn_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("tvmattn_inter_token_latency_seconds", "Time between a request's tokens", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.generated = Counter("tvmattn_generated_tokens", "Output tokens generated", registry=r)
        self.prompt = Counter("tvmattn_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.tokens_per_s = Gauge("tvmattn_output_tokens_per_second",
                                  f"Output tokens per second over the last {RATE_WINDOW_S:g} s", registry=r)
        self.sampled_device = Gauge("tvmattn_sampled_tokens_device",
                                    "Token choices made by the library's sampling kernels so far", registry=r)
        self.sampled_host = Gauge("tvmattn_sampled_tokens_host",
                                  "Token choices made by the host sampler so far (all with --sampling host; else "
                                  "grammar, logprobs and speculative verification rows)", registry=r)
        self.sampling_device = Gauge("tvmattn_sampling_device",
                                     "1 when the engine samples with the library's kernels, 0 on the host", registry=r)
        self.lookahead_steps = Gauge("tvmattn_lookahead_steps",
                                     "Decode steps launched before the previous step's tokens were read", registry=r)
        self.graph_sampled_steps = Gauge("tvmattn_graph_sampled_steps",
                                         "Lookahead steps whose tokens were sampled inside the step's CUDA graph",
                                         registry=r)
        self.lookahead_dropped = Gauge("tvmattn_lookahead_dropped_tokens",
                                       "Tokens lookahead steps computed past a request's end (dropped)", registry=r)
        self._samples: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._seen_generated = 0
        self._seen_prompt = 0
        engine.on_ttft = self.ttft.observe
        engine.on_inter_token = self.itl.observe

    def render(self) -> bytes:
        e = self.engine
        snap = e.snapshot
        self.running.set(snap["running"])
        self.waiting.set(snap["waiting"])
        if hasattr(e.runner.cache, "sequence_state"):  # tvmattn's cache: pages per sequence are readable
            used, held = e.held_pages()  # at one moment, between two steps
            self.pages_prefix.set(held)
        else:
            used = snap["pages_total"] - snap["pages_free"]
        self.pages_free.set(e.runner.num_pages - used)
        report = e.memory_report()
        if report is not None:
            self.bytes_held.set(report["held_bytes"])
            self.bytes_full.set(report["full_bytes"])
        self.pages_used.set(used)
        self.hit_rate.set(e.prefix.hit_rate if e.prefix is not None else 0.0)
        self.hit_tokens.set(e.prefix.hit_tokens if e.prefix is not None else 0)
        self.queried_tokens.set(e.prefix.queried_tokens if e.prefix is not None else 0)
        self.preemptions.set(e.preemptions)
        self.recomputed.set(e.recomputed_tokens)
        self.sampled_device.set(e.sampled_on_device)
        self.sampled_host.set(e.sampled_on_host)
        self.sampling_device.set(1 if e.sampling == "device" else 0)
        self.lookahead_steps.set(e.lookahead_steps)
        self.lookahead_dropped.set(e.lookahead_dropped)
        self.graph_sampled_steps.set(e.graph_sampled_steps)
        with self._lock:
            generated, prompt = e.generated_tokens, e.prompt_tokens
            self.generated.inc(generated - self._seen_generated)
            self.prompt.inc(prompt - self._seen_prompt)
            self._seen_generated, self._seen_prompt = generated, prompt
            now = time.monotonic()
            self._samples.append((now, generated))
            while len(self._samples) > 2 and now - self._samples[1][0] > RATE_WINDOW_S:
                self._samples.popleft()
            t0, g0 = self._samples[0]
            self.tokens_per_s.set((generated - g0) / (now - t0) if now > t0 else 0.0)
        return generate_latest(self.registry)
