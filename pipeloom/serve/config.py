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
    """Most actions a schedule built or simulated for a request may have (the view's data grows with them)."""
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

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port!r}")
        for name in ("max_body_bytes", "max_actions", "workers", "max_waiting", "kept_results"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("request_seconds", "max_search_seconds", "job_grace_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be more than 0 seconds, got {getattr(self, name)!r}")
