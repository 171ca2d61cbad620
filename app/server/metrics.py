"""The server's Prometheus metrics (GET /metrics), in the text format prometheus-client writes.

Names follow vLLM's where vLLM has one (its `vllm:` prefix becomes `ulysses_studio:`), so that dashboards built for
vLLM read them; the rest are this server's own, beside them:

    ulysses_studio:num_requests_running            requests on the ranks now (GET /status's `running`)
    ulysses_studio:num_requests_waiting            requests waiting in the server's queue (GET /status's `waiting`)
    ulysses_studio:e2e_request_latency_seconds     histogram: queued -> ended (its file's write not included)
    ulysses_studio:request_queue_time_seconds      histogram: queued -> its turn on a group of ranks
    ulysses_studio:request_success_total           requests that ended with a result, per model
    ulysses_studio:request_failure_total           requests that failed or were cancelled, per model
    ulysses_studio:stage_seconds                   histogram per stage: encode, step (each step), decode, write
    ulysses_studio:step_cache_hits_total           denoising steps that reused the step cache (--cache)
    ulysses_studio:step_cache_steps_total          denoising steps run with a step cache (hits included)
    ulysses_studio:busy_groups / :groups           groups of ranks running a request / groups the ranks form now
    ulysses_studio:rank_memory_bytes               per rank (global rank) and device, after its last request: a
                                                   GPU's peak allocated bytes, a CPU rank's resident bytes

Requests running and waiting, and the groups, are read from the queue when scraped; the others are counted as each
job ends (app.server.jobs.JobQueue's on_end) and as its file is written (app.server.submit.write). The registry is the
server's own (no process-wide state): two servers in one process would not mix their numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from app.ranks.lockstep import Generation
    from app.server.jobs import Job, JobQueue

PREFIX = "ulysses_studio:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text format."""
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
"""vLLM's e2e latency and queue time buckets (seconds)."""
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _QueueCollector(Collector):
    """Requests running and waiting, busy groups and groups, read from the queue at each scrape."""

    def __init__(self, jobs: JobQueue, groups: Callable[[], int]) -> None:
        self._jobs = jobs
        self._groups = groups

    def collect(self) -> Iterable[GaugeMetricFamily]:
        running, waiting = self._jobs.snapshot()
        yield GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests on the ranks now.", value=len(running))
        yield GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests waiting in the server's queue.",
                                value=len(waiting))
        yield GaugeMetricFamily(f"{PREFIX}busy_groups", "Groups of ranks running a request now (one request a group).",
                                value=len(running))
        yield GaugeMetricFamily(f"{PREFIX}groups", "Groups the ranks form now (--replicas).", value=self._groups())


class ServerMetrics:
    """The metrics of one server: `names` maps the queue's model keys to the served models' names."""

    def __init__(self, names: dict[str, str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._names = names
        labels = ["model_name"]
        self.latency = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Seconds from queued to ended.", labels,
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram(f"{PREFIX}request_queue_time_seconds", "Seconds from queued to running.", labels,
                                    buckets=LATENCY_BUCKETS, registry=self.registry)
        self.succeeded = Counter(f"{PREFIX}request_success", "Requests that ended with a result.", labels,
                                 registry=self.registry)
        self.failed = Counter(f"{PREFIX}request_failure", "Requests that failed or were cancelled.", labels,
                              registry=self.registry)
        self.stages = Histogram(f"{PREFIX}stage_seconds", "Seconds of each stage: encode, each step, decode, write.",
                                [*labels, "stage"], buckets=STAGE_BUCKETS, registry=self.registry)
        self.cache_hits = Counter(f"{PREFIX}step_cache_hits", "Denoising steps that reused the step cache.", labels,
                                  registry=self.registry)
        self.cache_steps = Counter(f"{PREFIX}step_cache_steps", "Denoising steps run with a step cache.", labels,
                                   registry=self.registry)
        self.rank_memory = Gauge(f"{PREFIX}rank_memory_bytes", "Each rank's memory after its last request: a GPU's "
                                 "peak allocated bytes, a CPU rank's resident bytes.", ["rank", "device"],
                                 registry=self.registry)

    def watch(self, jobs: JobQueue, groups: Callable[[], int]) -> None:
        """Read requests running and waiting, and the groups, from `jobs` and `groups()` at each scrape."""
        self.registry.register(_QueueCollector(jobs, groups))

    def job_ended(self, job: Job, outcome: Generation | str) -> None:
        """Count a job's end (JobQueue's on_end): its latency, queue time and, with a result, its stages."""
        name = self._names.get(job.model, job.model)
        self.latency.labels(name).observe(time.monotonic() - job.submitted_at)
        if job.started_at is not None:
            self.queue_time.labels(name).observe(job.started_at - job.submitted_at)
        if isinstance(outcome, str):
            self.failed.labels(name).inc()
            return
        self.succeeded.labels(name).inc()
        stages = outcome.stages
        if stages is not None:
            self.stages.labels(name, "encode").observe(stages.encode)
            for seconds in stages.steps:
                self.stages.labels(name, "step").observe(seconds)
            self.stages.labels(name, "decode").observe(stages.decode)
        if outcome.computed_steps is not None:
            self.cache_steps.labels(name).inc(outcome.request.steps)
            self.cache_hits.labels(name).inc(outcome.request.steps - outcome.computed_steps)
        for rank, (device, used) in (outcome.rank_memory or {}).items():
            self.rank_memory.labels(str(rank), device).set(used)

    def written(self, model: str, seconds: float) -> None:
        """Count a result file's write (app.server.submit.write); `model`: the served model's name."""
        self.stages.labels(model, "write").observe(seconds)

    def text(self) -> bytes:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.registry)
