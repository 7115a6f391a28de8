"""specrl: online speculative-decoding learning service.

The core library: settings, model assets, the target runtime and drafter, the
speculative step and the telemetry record. Processes (server, trainer) live in
`specrl.serving` and `specrl.trainer` and meet only through HTTP, Redis and the
weights store.
"""

__version__ = "0.1.0"
