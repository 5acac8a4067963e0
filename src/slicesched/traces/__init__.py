"""Request streams: loaders for public traces, the ServeGen multi-tenant generator, and the
built-in synthetic workload.

>>> from slicesched.traces import synthetic_trace
>>> t = synthetic_trace(duration_s=60, rate=2.0, seed=1)
>>> t.scale_rate(2).duration_s == t.duration_s / 2
True
"""

from slicesched.traces import formats as _formats  # noqa: F401  (registers built-in formats)
from slicesched.traces._sampling import LognormalLengths
from slicesched.traces.formats import load_azure, load_burstgpt, load_mooncake, load_plain_csv
from slicesched.traces.registry import (
    TraceFormat, get_trace_format, load_trace, register_trace_format, trace_formats)
from slicesched.traces.request import Trace, TraceRequest
from slicesched.traces.servegen import (
    SERVEGEN_LANGUAGE_LENGTHS, ServeGenClient, list_servegen_clients, servegen_model_dir,
    servegen_trace)
from slicesched.traces.synthetic import synthetic_trace

__all__ = [
    "Trace", "TraceRequest", "TraceFormat", "LognormalLengths",
    "register_trace_format", "load_trace", "trace_formats", "get_trace_format",
    "load_azure", "load_burstgpt", "load_mooncake", "load_plain_csv",
    "synthetic_trace",
    "ServeGenClient", "SERVEGEN_LANGUAGE_LENGTHS", "list_servegen_clients",
    "servegen_model_dir", "servegen_trace",
]
