"""Wire formats of the HTTP API: pydantic schemas with their limits (schemas.py), the compact frame
(frame.py, shared with the client) and its server side (arrays.py), and the fast JSON row reader
(jsonrows.py, with the native _jsonrows.c). Nothing here knows the engine or the batcher.

Importing this package imports nothing: the client reads frame.py without the server's stack."""
