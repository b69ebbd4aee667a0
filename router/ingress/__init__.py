"""The ingress deployment: OpenAI HTTP and gRPC."""
