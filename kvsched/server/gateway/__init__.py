"""The engine protocol a gateway speaks (smg's `vllm.grpc.engine.VllmEngine`, docs/GATEWAY.md),
served beside kvsched's own services when the `gateway` extra (smg-grpc-proto) is installed."""
