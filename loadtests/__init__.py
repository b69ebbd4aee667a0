"""Load tests: locust users (HTTP SSE, gRPC), seeded workloads, the prefill:decode ratio sweep
and its report. See docs/loadtests.md."""
