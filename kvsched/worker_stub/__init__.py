"""The reference worker: slot state machine, executors (`sim`, `model`) and the gRPC client."""
