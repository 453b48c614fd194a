"""A front process: the public gRPC and OpenAI HTTP APIs over an engine core.

Fronts hold no scheduling state. They do every per-request and per-token piece of work (guards,
input checks and tokenization, prompt block hashing, detokenization, stop strings, tool calls,
streams) so that an engine core's loop does nothing a request's size can stretch. A front never
imports the engine or the scheduling state: it reaches a core only through the front link
(``core_link.py``, messages in ``pagedserve/wire/front_messages.py``).
"""
