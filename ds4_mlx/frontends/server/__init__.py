"""`ds4-mlx serve`: OpenAI, Anthropic and Responses APIs over one inference worker.

Layout (frontend layer; the engine is reached only through :mod:`.backend`):

* :mod:`.events`     - the protocol-neutral request and event types between HTTP and the engine.
* :mod:`.backend`    - the worker thread that owns the model, its bounded FIFO and cancellation.
* :mod:`.parse`      - request bodies of the four APIs -> :class:`~.events.ChatRequest`.
* :mod:`.turn`       - one generation as the client sees it: stop strings, tool-call ids, replay.
* :mod:`.openai_api`, :mod:`.anthropic_api`, :mod:`.responses_api` - response and SSE shapes.
* :mod:`.app`        - the Starlette application: routes, auth, limits, errors, metrics.
"""

from ds4_mlx.frontends.server.app import ServerConfig, create_app
from ds4_mlx.frontends.server.backend import Backend, EngineBackend, Job, QueueFull, ShuttingDown
from ds4_mlx.frontends.server.events import ChatRequest

__all__ = ["Backend", "ChatRequest", "EngineBackend", "Job", "QueueFull", "ServerConfig",
           "ShuttingDown", "create_app"]
