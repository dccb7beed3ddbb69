"""The gRPC layer: translates messages, validates input, maps errors to status codes, exports metrics."""
