"""Prefill-decode disaggregation: a prefill instance computes a prompt's KV and writes it
straight into a decode instance's device pool (Mooncake TransferEngine), then hands over
the first token; the decode instance generates the rest.

- ``config``: the mode and its settings (``hicache serve --disaggregation-*``);
- ``pool_descriptor``: where a pool's pages lie in memory, as addresses a peer can write;
- ``transfer_engine``: the Mooncake TransferEngine over the device pool's buffer;
- ``rooms``: the prefill side's table of rooms (one per request) and their states;
- ``bootstrap_server`` / ``bootstrap_client``: the handshake over HTTP;
- ``kv_sender`` (prefill) / ``kv_receiver`` (decode): the threads that move the KV.

A request's path: the router (``hicache router --pd-disaggregation``) sends the same body,
with ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``, to both instances at
once. The decode instance allocates the prompt's device pages without computing them and
registers them in that room; the prefill instance computes the prompt (reusing L1, L2 and
L3) up to the first token, writes the prompt's pages into the decode pool and closes the
room with that token; the decode instance then admits the request into its decode batch.
With ``n`` samples each sample has a room of its own, derived from the request's. With
decode offload (``--disaggregation-decode-enable-offload-kvcache``) a finished request's
pages go into the decode instance's tree, and from there to L3 under the same keys.

The scheduler's side lives in the engine (``pd_prefill``: a request handed off after its
first token, its pages held until the transfer ends; ``pd_decode``: pages allocated, the
request held until its KV landed; ``disaggregation``: the wiring). Invariant: a side frees
a request's pages only once its transfer ended (done, failed or given up and waited for),
so no write lands in freed pages.
"""
