"""The "redis" backend: pages in a Redis or Valkey server's memory, spoken to in pipelined RESP."""
