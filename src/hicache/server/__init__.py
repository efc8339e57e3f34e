"""``hicache serve``: the HTTP server, OpenAI and SGLang-style, over an engine.

- flags: ``args`` (the cache's) and ``engine_args`` (the rest, turned into a frozen
  ``EngineConfig``; the engine never sees argparse); ``serve`` starts it all;
- the app and its routes: ``app``, ``openai_api``, ``generate_api``, ``native_api``
  (tokenize, health_generate, abort), ``admin_api`` (the L3 backend at run time, its
  store paths confined by ``l3_path_root``), ``server_info``, ``metrics``;
- request bodies: ``protocol``, ``chat_protocol``, ``generate_protocol`` (unimplemented
  fields accepted only at their neutral values), ``bootstrap_fields`` (disaggregation),
  limited by ``body_limit`` (a 413 before they are read) and parsed off the event loop
  when large (``body``);
- prompts and outputs: ``tokenization`` and ``chat_prompt`` (on a worker thread),
  ``output_text`` (text and stop handling), ``tool_parser``, ``structured_output``
  (json_schema, regex, ebnf, response_format and forced tool_choice as a
  ``GrammarSpec``), ``logprobs_format``, ``sse``;
- one engine request as a route consumes it: ``generation``, ``choices`` (``n`` samples
  as n engine requests sharing the cached prompt), ``client_watch`` (a client that
  leaves aborts its request, queued or running);
- ``errors`` (one error shape; a 500 leaves the connection usable), ``access_log`` (a
  line per request with its tokens, never its text), ``state`` (what every route needs).

Invariants: tokenization, chat templates and large bodies are handled off the event
loop; every failure answers in the OpenAI error shape.
"""
