"""gRPC beside HTTP: KServe v2's GRPCInferenceService and TF Serving's PredictionService and ModelService,
with grpc.health.v1 and server reflection, over the same app, models and data plane as the HTTP routes.

Imports grpcio and the vendored messages (app/grpc/protos), never TensorFlow.
"""
