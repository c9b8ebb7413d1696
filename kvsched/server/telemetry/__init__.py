"""What the daemon shows of itself: Prometheus metrics, OpenTelemetry spans and their OTLP export, structured logs."""
