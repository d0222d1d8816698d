"""Cutting the model: tracing it (tracing), splitting it into stages (split), graph rewrites (passes), train/eval modes
(modes), and putting pieces on their device (materialize)."""
