"""Tenancy: a tenant is a cache salt (``GenerateRequest.extra_key``; None: the default tenant)."""
