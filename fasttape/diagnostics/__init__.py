"""Diagnostics: explain a None gradient, anomaly mode, summary/to_dot, the
per-op profiler. Imports the recording and gradients layers and the core."""
