"""Tenancy: a tenant is a cache salt (``GenerateRequest.extra_key``; None is the default
tenant), and everything the cache keeps or counts per tenant."""
