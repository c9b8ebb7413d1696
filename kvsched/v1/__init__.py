"""Generated protobuf and gRPC code for kvsched.v1: produced by `make proto`, do not edit."""
