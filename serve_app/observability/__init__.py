"""Grafana dashboard as code, its provisioning, and the Prometheus queries behind it."""
