"""Prometheus metrics that fronts and engine cores both export, and how they add up to one /metrics."""
