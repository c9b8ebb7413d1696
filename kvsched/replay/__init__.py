"""Trace replay against a running daemon through the public gRPC API (`kvsched replay`,
`kvsched demo`): arrivals at the trace's times, per-request timings, one summary."""
