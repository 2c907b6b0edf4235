"""The benchmark harness behind ``specdec bench`` (latency over prompt sets, forward cost)."""
