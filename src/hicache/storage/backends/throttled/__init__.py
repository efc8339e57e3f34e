"""The "throttled" backend: another backend behind a simulated latency and bandwidth (a test
and benchmark tool)."""
