"""Generated gRPC messages and stubs (tools/gen_grpc_protos.py)."""
