"""`seq2seq serve`: an HTTP translation service with dynamic batching.

`options` (the server's own settings, stdlib only), `engine` (what the server
needs from a model: the PyTorch `Translator` or another engine), `batcher`
(groups concurrent requests into batches, decodes off the event loop), `app`
(the Starlette routes: parsing, limits, errors) and `server` (the socket,
uvicorn and the signals). Only `options` may be imported without the `serve`
extra installed.
"""
