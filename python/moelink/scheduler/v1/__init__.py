"""Code generated from proto/moelink/scheduler/v1/scheduler.proto at build
time (scheduler_pb2, scheduler_pb2_grpc; grpcio-tools)."""
