"""Prefill-decode disaggregation: a prefill instance computes a prompt's KV and writes it
straight into a decode instance's device pool (Mooncake TransferEngine), then hands over
the first token; the decode instance generates the rest.

- ``config``: the mode and its settings (``hicache serve --disaggregation-*``);
- ``pool_descriptor``: where a pool's pages lie in memory, as addresses a peer can write;
- ``transfer_engine``: the Mooncake TransferEngine over the device pool's buffer;
- ``rooms``: the prefill side's table of rooms (one per request) and their states;
- ``bootstrap_server`` / ``bootstrap_client``: the handshake over HTTP;
- ``kv_sender`` (prefill) / ``kv_receiver`` (decode): the threads that move the KV.
"""
