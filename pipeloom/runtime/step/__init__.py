"""One step on one rank: the actions (run), backward passes (backward), the loss (loss), random numbers (rng), action
timing (timing), what the rank runs (pieces), the ranks' agreement on a step (agree), two-replica and shared-
parameter gradients (replicas, shared)."""
