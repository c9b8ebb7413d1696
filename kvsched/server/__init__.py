"""The kvsched daemon: gRPC services, one engine loop per instance, proto<->core conversion."""
