"""The gRPC front door: KServe v2's GRPCInferenceService and TF Serving's PredictionService and ModelService,
with grpc.health.v1 and server reflection, reading protobuf messages into calls on the same data plane
(app/protocol) as the HTTP routes. It imports neither Flask nor app/http.

Imports grpcio and the vendored messages (app/grpc/protos), never TensorFlow.
"""
