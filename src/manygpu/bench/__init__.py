"""Benchmarks that return data first (rows, fits); tables, JSON and plots are views."""
