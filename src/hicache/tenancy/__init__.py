"""Tenancy: who a request's cached pages belong to.

A tenant is a cache salt: whatever names it (the body's ``cache_salt`` /
``extra_key``, an API key's tenant, a trusted gateway's header) ends as the
engine request's ``extra_key`` (None: the default tenant), which seeds every page
key, keys the tree's root children and names L3 objects, so two tenants never share
a page in any tier.

- ``names``: the default tenant's label, the rule for tenant names and which
  namespaces nest inside a tenant (``within_tenant``);
- ``identity``: ``--api-keys`` files, ``--tenant-header``, and the precedence that
  turns a request's credentials and body into its tenant;
- ``keys``: ``--l3-encryption-keys`` files, the AES-GCM keys L3 pages are sealed with
  per tenant (``storage/sealing.py``);
- ``quotas``: ``--tenant-quotas`` files, the L3 bytes and page age each tenant may keep
  (enforced by the L3 backends, ``storage/tenant_pages.py``);
- what the cache keeps per tenant (page counts per tier, host quotas, purge) lives with
  the tree (``radix/tree.py``) and the cache (``cache/hierarchical_cache.py``).
"""
