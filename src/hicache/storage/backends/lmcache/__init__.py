"""The "lmcache" backend: pages in an LMCache server, spoken to over TCP by our own client."""
