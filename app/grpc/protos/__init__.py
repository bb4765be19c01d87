"""Generated gRPC messages and stubs (scripts/gen_grpc_protos.py)."""
