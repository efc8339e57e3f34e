"""Tenancy: who a request's cached pages belong to, and what each tenant may do with them.

A tenant is a cache salt (``GenerateRequest.extra_key``; None is the default tenant).
The salt seeds every page key, so tenants never share a page in any tier.
"""
