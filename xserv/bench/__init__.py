"""`xserv bench`: throughput (offline), latency (batch 1), serve (HTTP clients against a running server)."""
