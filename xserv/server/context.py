"""What every request handler of the OpenAI-compatible server shares: the engine, the tokenizer, the model's limits,
the admission checks and the metrics."""
from __future__ import annotations

from dataclasses import dataclass, field

from .async_engine import AsyncEngine
from .metrics import ServerMetrics
from .protocol import APIError


@dataclass
class ServerContext:
    engine: AsyncEngine
    tokenizer: object
    model_name: str
    max_model_len: int
    vocab_size: int
    max_in_flight: int  # sequences running + queued before new requests get 503
    sampling_defaults: dict = field(default_factory=dict)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    draining: bool = False
    num_requests: int = 0  # requests in the engine (a request has n sequences)

    def check_serving(self, num_choices: int) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine.error is not None:
            raise APIError(503, "the engine failed; the server is exiting", code="engine_failed")
        if self.engine.num_in_flight + num_choices > self.max_in_flight:
            self.metrics.rejected += 1
            raise APIError(503, f"the server is overloaded: {self.engine.num_in_flight} sequences in flight, the "
                                f"limit is {self.max_in_flight} (--max-num-seqs + --max-waiting); retry later",
                           code="overloaded")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
