"""The settings of ``pipeloom serve``: where it listens and the limits that keep one request or one
client from taking the machine."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServeConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    """Where the server listens and its limits."""

    host: str = "127.0.0.1"
    """Address to bind; the default serves this machine only (give 0.0.0.0 to serve others)."""
    port: int = 8765
    """TCP port (0: any free one)."""
    max_body_bytes: int = 4 * 2**20
    """Largest request body (a cost table or a schedule); larger ones get 413."""
    request_seconds: float = 30.0
    """Wall-time limit of a request that computes (simulate, compare, plan); past it 504."""
    max_actions: int = 100_000
    """Most work a request may ask for, in actions (see :mod:`pipeloom.serve.limits`): a schedule's actions plus
    its ranks; a compare's sum over its schedules; a plan's sum over every candidate its search would build."""
    workers: int = 2
    """Worker processes running searches and plans at once."""
    max_waiting: int = 64
    """Jobs (searches, plans) waiting for a worker at most; more get 429."""
    max_search_seconds: float = 120.0
    """Longest time limit a search may ask for."""
    job_grace_seconds: float = 15.0
    """Time a job may run past its own limit before its worker is stopped (and the job times out)."""
    kept_results: int = 256
    """Finished searches and plans kept for download; the oldest go first."""
    kept_bytes: int = 256 * 2**20
    """Most bytes of JSON text the kept results may hold together; past it the oldest go first."""
    kept_seconds: float = 3600.0
    """Time a finished search or plan is kept for download."""
    quick_workers: int = 2
    """Simulate, compare and download requests computed at once (each in a worker process); others wait."""
    max_quick_waiting: int = 64
    """Quick requests waiting for a worker at most; more get 429."""
    worker_memory_bytes: int = 2**30
    """Address space a worker process may add to what it starts with (RLIMIT_AS); past it the request fails
    with 507 and the worker is gone."""
    max_connections: int = 512
    """Open connections at most; a new one past it closes the oldest that carries no request."""
    first_request_seconds: float = 10.0
    """Time a connection has to send a whole request head (first, or next after a keep-alive answer)."""
    max_requests: int = 256
    """Requests in progress at once (waiting or computing); more get 503."""
    allowed_hosts: tuple[str, ...] = ()
    """Names the server answers to besides those it binds (the Host header); ``"*"``: any (unsafe: it lets
    a DNS-rebinding page read the API)."""

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port!r}")
        for name in ("max_body_bytes", "max_actions", "workers", "max_waiting", "kept_results", "kept_bytes",
                     "quick_workers", "max_quick_waiting", "worker_memory_bytes", "max_connections", "max_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("request_seconds", "max_search_seconds", "job_grace_seconds", "kept_seconds",
                     "first_request_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be more than 0 seconds, got {getattr(self, name)!r}")
        if not isinstance(self.allowed_hosts, tuple) or not all(isinstance(h, str) and h for h in self.allowed_hosts):
            raise ValueError(f"allowed_hosts must be a tuple of host names, got {self.allowed_hosts!r}")
