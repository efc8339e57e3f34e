"""``hicache router``: one endpoint in front of several workers, routing by where KV lives.

- ``settings`` (flags) and ``serve`` (discovery, then the app); ``app`` (routes, admin
  routes, body limit and admin key) and, with ``--pd-disaggregation``, ``pd_app``,
  ``pd_pools`` and ``pd_proxy`` (one request to a prefill and a decode instance at once);
- workers: ``workers`` (discovery from /get_server_info, one page size and model for
  all), ``health`` (when a worker leaves routing: failures in a row, never slowness
  alone), ``credentials`` (worker URLs' credentials masked everywhere);
- what workers hold: ``subscriber`` (one per worker: its KV events in sequence order,
  gaps filled from its replay socket, a restart rebuilt) into ``index`` (page hash to
  per-tier worker masks, L3 shared by all); ``shared_pool`` (the shared L3 asked
  directly, on one lookup thread, under a deadline); ``tier_costs`` (each worker's
  measured cost of a page per tier);
- deciding and forwarding: ``prompt`` (the prompt as the worker will tokenize it, hashed
  into pages), ``policy`` (round_robin, least_load, cache_aware, tier_aware) behind
  ``types``' interfaces, ``proxy`` (answers streamed through byte for byte, retried only
  before the first byte), ``fan_out`` (requests every worker must hear), ``metrics``.

Invariants: the event loop never waits on storage or a worker's events (subscribers run
on it, lookups on their thread); a client that leaves drops the worker's request.
"""
